"""MDL mining of macro skills: abstract successful action sequences, keep the sub-sequences that compress them most.

docs/algorithms.md section 9, "Mining from trajectories" [I: ReuseRL MDL dictionary, SGDR sliding window, LAR]; the
criterion is the minimum description length principle (Rissanen 1978) with greedy code-table selection as in Krimp
(Vreeken, van Leeuwen & Siebes, "Krimp: mining itemsets that compress", 2011). Our formulation:

1. **Abstraction.** An *entity* is ``<word> <number>`` (``fridge 1``, ``apple 12``) that does not open the action
   (there the word is the verb: ``raise 20`` stays literal) and whose word is not a direction (``go north 2`` stays
   literal). Within one sequence (a whole trajectory or one window) entities become slots ``{a}``, ``{b}``, ... in
   order of first appearance, the same entity always the same slot: ``go to fridge 1; open fridge 1`` ->
   ``go to {a}; open {a}``. Literal braces are doubled (``{{``, ``}}``) as in ``str.format``.
2. **Candidates.** Every window of 2..max_length consecutive actions, keyed by its abstraction (slots bound within
   the window). An empty action ("" = an invalid step) is a symbol of the corpus but never inside a macro.
3. **Description length** of a dictionary D (an ordered list of macros) over the corpus:
   ``DL(D) = sum_{m in D} (|m| + 1) + |encode(corpus, D)|``, where ``encode`` takes the macros in order and replaces
   each non-overlapping, left-to-right occurrence among still-primitive actions by one symbol. A macro with n such
   occurrences changes DL by ``n * (|m| - 1) - (|m| + 1)``: a pair needs 4 occurrences to pay off, a triple 3, a
   5-step routine 2. Greedy: add the candidate with the largest decrease (ties: longer, then the smaller key),
   stop when none decreases DL or ``max_skills`` are chosen.
4. **Skills.** Each chosen macro becomes a ``Skill`` whose ``macro`` is the abstracted action list; a harness runs it
   as one action with ``instantiate_macro`` and recognizes it in a trajectory with ``match_macro``.
"""
from __future__ import annotations

import hashlib
import re
from collections import defaultdict
from typing import Mapping, NamedTuple, Sequence

from skills.bank import Skill
from skills.mining import DIRECTION_WORDS, MAX_PROVENANCE

_DIRECTIONS = "|".join(sorted(DIRECTION_WORDS))
ENTITY_PATTERN = rf"(?!(?i:{_DIRECTIONS}) \d)[A-Za-z][A-Za-z_]* \d+"
"""Regex of one entity value (``fridge 1``); a slot of a macro binds exactly such a value."""
_ENTITY_RE = re.compile(rf"(?<!\w)({ENTITY_PATTERN})(?!\w|\.\d)")
_TEMPLATE_TOKEN_RE = re.compile(r"\{\{|\}\}|\{([a-z][a-z0-9_]*)\}|[^{}]+")

Parsed = tuple[tuple[str, ...], tuple[str, ...]]
"""One action split at its entities: (escaped literal pieces, len = entities + 1; entities)."""


# ------------------------------------------------------------------------------------------------ abstraction

def _escape(text: str) -> str:
    return text.replace("{", "{{").replace("}", "}}")


def slot_name(index: int) -> str:
    """The index-th slot name: a, b, ..., z, aa, ab, ... (spreadsheet columns, lowercase)."""
    name = ""
    index += 1
    while index:
        index, rest = divmod(index - 1, 26)
        name = chr(ord("a") + rest) + name
    return name


def _parse_action(action: str) -> Parsed:
    pieces, entities, last = [], [], 0
    for match in _ENTITY_RE.finditer(action):
        if not action[:match.start()].strip():
            continue  # the first word is the verb, not an object: `raise 20`
        pieces.append(_escape(action[last:match.start()]))
        entities.append(match.group(1))
        last = match.end()
    pieces.append(_escape(action[last:]))
    return tuple(pieces), tuple(entities)


def _abstract_parsed(steps: Sequence[Parsed]) -> tuple[tuple[str, ...], list[dict[str, str]]]:
    slot_of: dict[str, str] = {}  # entity -> slot, bound for the whole sequence
    symbols, bindings = [], []
    for pieces, entities in steps:
        out, bound = [pieces[0]], {}
        for entity, piece in zip(entities, pieces[1:]):
            slot = slot_of.setdefault(entity, slot_name(len(slot_of)))
            out += ["{", slot, "}", piece]
            bound[slot] = entity
        symbols.append("".join(out))
        bindings.append(bound)
    return tuple(symbols), bindings


def abstract_actions(actions: Sequence[str]) -> tuple[tuple[str, ...], list[dict[str, str]]]:
    """Replace the entities of ``actions`` by slots bound across the whole sequence.

    Returns (abstract symbols, one per action; per action, the slots it uses -> their entities)::

        abstract_actions(["go to fridge 1", "open fridge 1", "take apple 2 from fridge 1"])
        == (("go to {a}", "open {a}", "take {b} from {a}"),
            [{"a": "fridge 1"}, {"a": "fridge 1"}, {"b": "apple 2", "a": "fridge 1"}])
    """
    return _abstract_parsed([_parse_action(a) for a in actions])


def _parse_template(step: str) -> list[tuple[bool, str]]:
    """``take {b} from {a}`` -> [(False, "take "), (True, "b"), (False, " from "), (True, "a")]."""
    tokens, pos = [], 0
    while pos < len(step):
        match = _TEMPLATE_TOKEN_RE.match(step, pos)
        if match is None:
            raise ValueError(f"macro step {step!r}: stray brace at column {pos}; write slots as {{name}} (lowercase "
                             f"name) and literal braces as {{{{ and }}}}")
        text = match.group(0)
        tokens.append((True, match.group(1)) if match.group(1) else (False, {"{{": "{", "}}": "}"}.get(text, text)))
        pos = match.end()
    return tokens


def canonical_macro(macro: Sequence[str]) -> tuple[str, ...]:
    """``macro`` with its slots renamed a, b, ... in order of first appearance (the form the miner produces)."""
    rename: dict[str, str] = {}
    out = []
    for step in macro:
        out.append("".join("{" + rename.setdefault(text, slot_name(len(rename))) + "}" if is_slot else _escape(text)
                           for is_slot, text in _parse_template(step)))
    return tuple(out)


def instantiate_macro(macro: Sequence[str], bindings: Mapping[str, str]) -> list[str]:
    """The concrete actions of ``macro`` with each slot replaced by ``bindings[slot]``.

    Every slot of the macro must be bound and every binding used, else ValueError naming them.
    """
    parsed = [_parse_template(step) for step in macro]
    used = {text for tokens in parsed for is_slot, text in tokens if is_slot}
    missing, extra = sorted(used - set(bindings)), sorted(set(bindings) - used)
    if missing or extra:
        raise ValueError(f"instantiate_macro: slots {sorted(used)} of {list(macro)}; missing bindings {missing}, "
                         f"unknown bindings {extra}")
    return ["".join(bindings[text] if is_slot else text for is_slot, text in tokens) for tokens in parsed]


def match_macro(macro: Sequence[str], actions: Sequence[str]) -> dict[str, str] | None:
    """Slot bindings under which ``macro`` instantiates to exactly ``actions``, else None.

    A slot binds one entity (``ENTITY_PATTERN``), the same in every step, and distinct slots bind distinct entities,
    so for a macro the miner produced this matches exactly the windows that abstract to it.
    """
    if len(macro) != len(actions):
        return None
    bindings: dict[str, str] = {}
    for step, action in zip(macro, actions):
        pattern, in_step = [], set()
        for is_slot, text in _parse_template(step):
            if not is_slot:
                pattern.append(re.escape(text))
            elif text in bindings:
                pattern.append(re.escape(bindings[text]))
            elif text in in_step:
                pattern.append(f"(?P={text})")
            else:
                pattern.append(f"(?P<{text}>{ENTITY_PATTERN})")
                in_step.add(text)
        match = re.fullmatch("".join(pattern), action)
        if match is None:
            return None
        bindings.update(match.groupdict())
    return bindings if len(set(bindings.values())) == len(bindings) else None


# ------------------------------------------------------------------------------------------- description length

def description_length(action_sequences: Sequence[Sequence[str]], macros: Sequence[Sequence[str]]) -> int:
    """``DL(D) = sum_{m in D} (|m| + 1) + |encode(corpus, D)|`` with the macros applied in order (module docstring).

    A plain loop over the corpus; the miner computes the same quantity incrementally.
    """
    keys = [canonical_macro(m) for m in macros]
    parsed = [[_parse_action(a) for a in actions] for actions in action_sequences]
    covered = [[False] * len(actions) for actions in action_sequences]
    encoded = sum(len(actions) for actions in action_sequences)
    for key in keys:
        length = len(key)
        for actions, steps, cover in zip(action_sequences, parsed, covered):
            start = 0
            while start + length <= len(actions):
                span = range(start, start + length)
                if (not any(cover[i] for i in span) and all(actions[i] for i in span)
                        and _abstract_parsed(steps[start:start + length])[0] == key):
                    for i in span:
                        cover[i] = True
                    encoded -= length - 1
                    start += length
                else:
                    start += 1
    return sum(len(k) + 1 for k in keys) + encoded


class MacroChoice(NamedTuple):
    """One macro the greedy MDL selection chose, in selection order."""
    macro: tuple[str, ...]
    gain: int
    """Decrease of the description length when it was added (> 0)."""
    count: int
    """Occurrences it encodes (non-overlapping, among actions no earlier macro took)."""
    trajectory_ids: tuple[str, ...]
    """Sorted ids of the trajectories holding those occurrences."""
    example: dict[str, str]
    """Bindings of its first occurrence (in the smallest trajectory id)."""


def _window_occurrences(parsed: list[list[Parsed]], actions: list[Sequence[str]],
                        max_length: int) -> dict[tuple[str, ...], list[tuple[int, int]]]:
    """Abstraction key of every window of 2..max_length valid actions -> its (trajectory, start) positions, sorted."""
    occurrences: dict[tuple[str, ...], list[tuple[int, int]]] = defaultdict(list)
    for index, (steps, raw) in enumerate(zip(parsed, actions)):
        for start in range(len(steps)):
            slot_of: dict[str, str] = {}
            symbols: list[str] = []
            for end in range(start, min(start + max_length, len(steps))):
                if not raw[end]:
                    break  # an invalid step ends every window through it
                pieces, entities = steps[end]
                out = [pieces[0]]
                for entity, piece in zip(entities, pieces[1:]):
                    out += ["{", slot_of.setdefault(entity, slot_name(len(slot_of))), "}", piece]
                symbols.append("".join(out))
                if len(symbols) >= 2:
                    occurrences[tuple(symbols)].append((index, start))
    return occurrences


def _usable(positions: list[tuple[int, int]], length: int, covered: list[bytearray]) -> list[tuple[int, int]]:
    """Non-overlapping left-to-right occurrences among actions no chosen macro covers yet."""
    used, last_index, last_end = [], -1, 0
    for index, start in positions:
        if (index == last_index and start < last_end) or any(covered[index][start:start + length]):
            continue
        used.append((index, start))
        last_index, last_end = index, start + length
    return used


def select_mdl_dictionary(trajectories: Sequence[tuple[str, Sequence[str]]], *, max_length: int = 5,
                          min_count: int = 2, max_skills: int = 10) -> list[MacroChoice]:
    """Greedy MDL dictionary over ``trajectories`` ((id, actions), ids unique), in selection order.

    Deterministic and independent of the input order (trajectories are processed sorted by id).
    """
    if max_length < 2:
        raise ValueError(f"max_length must be >= 2 (a macro has at least two steps), got {max_length}")
    if min_count < 1:
        raise ValueError(f"min_count must be >= 1, got {min_count}")
    if max_skills < 0:
        raise ValueError(f"max_skills must be >= 0, got {max_skills}")
    ids = [tid for tid, _ in trajectories]
    if len(set(ids)) != len(ids):
        raise ValueError("mine_mdl_skills: duplicate trajectory ids in trajectories")
    ordered = sorted(trajectories, key=lambda item: item[0])
    actions = [list(acts) for _, acts in ordered]
    cache: dict[str, Parsed] = {}
    parsed = [[cache[a] if a in cache else cache.setdefault(a, _parse_action(a)) for a in acts] for acts in actions]
    occurrences = _window_occurrences(parsed, actions, max_length)
    # a candidate can only lose occurrences as macros are chosen: drop those that cannot pay off even now
    candidates = sorted(((key, pos) for key, pos in occurrences.items()
                         if len(pos) >= min_count and len(pos) * (len(key) - 1) > len(key) + 1),
                        key=lambda item: (-len(item[0]), item[0]))
    covered = [bytearray(len(acts)) for acts in actions]
    choices: list[MacroChoice] = []
    while len(choices) < max_skills:
        best: tuple[int, tuple[str, ...], list[tuple[int, int]]] | None = None
        for key, positions in candidates:
            length = len(key)
            if best is not None and len(positions) * (length - 1) - (length + 1) <= best[0]:
                continue  # its upper bound cannot beat the best so far
            used = _usable(positions, length, covered)
            gain = len(used) * (length - 1) - (length + 1)
            if len(used) >= min_count and gain > 0 and (best is None or gain > best[0]):
                best = (gain, key, used)  # candidates come longest first, then by key: ties keep the earlier one
        if best is None:
            break
        gain, key, used = best
        for index, start in used:
            covered[index][start:start + len(key)] = b"\x01" * len(key)
        first_index, first_start = used[0]
        first_window = parsed[first_index][first_start:first_start + len(key)]
        example = {slot: entity for bound in _abstract_parsed(first_window)[1] for slot, entity in bound.items()}
        choices.append(MacroChoice(key, gain, len(used), tuple(sorted({ordered[i][0] for i, _ in used})), example))
        candidates = [(k, p) for k, p in candidates if k != key]
    return choices


# ------------------------------------------------------------------------------------------------ skills

def macro_skill_name(macro: Sequence[str]) -> str:
    """``macro-go-to-a-open-a-take-b-from-a-1f2e3d4c``: the steps as a slug plus a hash of the macro, so the name
    is valid (``validate_skill_name``) and distinct for distinct macros."""
    slug = "macro-" + "-".join(re.sub(r"[^a-z0-9_]+", "-", step.lower()).strip("-") or "x" for step in macro)
    digest = hashlib.sha1("\x1f".join(macro).encode("utf-8")).hexdigest()[:8]
    return f"{slug[:55].rstrip('-_')}-{digest}"


def _readable(step: str) -> str:
    return "".join(f"<{text}>" if is_slot else text for is_slot, text in _parse_template(step))


def describe_macro(macro: Sequence[str], example: Mapping[str, str] | None = None,
                   example_id: str | None = None) -> str:
    """Markdown procedure: the steps with their slots, and an example binding."""
    slots = sorted({text for step in macro for is_slot, text in _parse_template(step) if is_slot},
                   key=lambda s: (len(s), s))
    if slots:
        head = ("Run these steps as one routine. Bind each slot (" + ", ".join(f"{{{s}}}" for s in slots)
                + ") to one numbered object or receptacle: a slot names the same thing in every step, different "
                  "slots name different things.")
    else:
        head = "Run these steps as one routine."
    lines = [head, ""] + [f"{i}. `{step}`" for i, step in enumerate(macro, start=1)]
    if slots and example:
        where = f" (trajectory {example_id})" if example_id else ""
        lines += ["", f"Example{where}: " + ", ".join(f"{{{s}}} = {example[s]}" for s in slots if s in example) + "."]
    return "\n".join(lines)


def mine_mdl_skills(trajectories: list[tuple[str, list[str]]], *, max_length: int = 5, min_count: int = 2,
                    max_skills: int = 10) -> list[Skill]:
    """Macro skills from SUCCESSFUL trajectories ((id, actions), ids unique) by greedy MDL, best (first chosen) first.

    ``stats``: mdl_gain (DL decrease when chosen), count (occurrences encoded), length (steps), support (fraction of
    trajectories holding an encoded occurrence). ``provenance``: those trajectories' ids, sorted, at most
    ``MAX_PROVENANCE``. Random sequences without recurring structure give no skill.
    """
    choices = select_mdl_dictionary(trajectories, max_length=max_length, min_count=min_count, max_skills=max_skills)
    total = len(trajectories)
    skills = []
    for choice in choices:
        support = len(choice.trajectory_ids) / total
        steps = ", then ".join(_readable(step) for step in choice.macro)
        skills.append(Skill(
            name=macro_skill_name(choice.macro),
            when_to_use=(f"When the next steps are to {steps}: successful episodes repeated this "
                         f"{len(choice.macro)}-step routine {choice.count} times ({support:.0%} of them)."),
            procedure=describe_macro(choice.macro, choice.example, choice.trajectory_ids[0]),
            provenance=choice.trajectory_ids[:MAX_PROVENANCE],
            stats={"mdl_gain": choice.gain, "count": choice.count, "length": len(choice.macro),
                   "support": round(support, 6)},
            macro=choice.macro,
        ))
    return skills


def macro_slots(macro: Sequence[str]) -> list[str]:
    """The slot names of ``macro`` in order of first appearance (``go to {a}; take {b} from {a}`` -> [a, b])."""
    seen: dict[str, None] = {}
    for step in macro:
        for is_slot, text in _parse_template(step):
            if is_slot:
                seen.setdefault(text)
    return list(seen)


def bind_macro_arguments(macro: Sequence[str], arguments: str) -> list[str] | None:
    """The concrete actions of ``macro`` called with ``arguments``: its entities (``apple 1 fridge 2``), bound to the
    macro's slots in order of first appearance. None when the count of entities differs from the count of slots
    (a slot-free macro takes no arguments) or two slots would bind the same entity."""
    values = [m.group(1) for m in _ENTITY_RE.finditer(arguments)]
    slots = macro_slots(macro)
    if len(values) != len(slots) or len(set(values)) != len(values):
        return None
    return instantiate_macro(macro, dict(zip(slots, values)))
