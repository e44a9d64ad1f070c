"""The two multi-turn training layouts (docs/algorithms.md §3), built from the data pool's exact token ids.

step rows:    one row per (trajectory, step): that step's prompt_ids + response_ids; the loss sees the response.
concatenated: one row per trajectory: prompt of step 0, response 0, the text between turns (observation and template),
              response 1, ... The loss sees every response; ECHO (models.aux_losses) sees the observation tokens.

Response ids always come from the records as the engine sampled them: model output is never re-tokenized. Only the
text *between* turns may be tokenized here, and only when the next step's prompt_ids do not extend the previous
prompt + response (see `concatenated`); that text is environment output and prompt template, never model output.

`collate_rows` pads rows into the next-token alignment of `models.trainer.collate`: position t of every [B, L] tensor
describes the token at t + 1, the one the logits at t predict.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Protocol, Sequence

import torch
from torch import Tensor

from models.batching import check_staleness



class StepRecord(Protocol):
    """What the layouts read of a step (datapool.records.StepRecord is one; models/ does not import datapool).

    A step may also carry ``staleness: int`` (rounds between the policy that sampled it and the one being trained,
    e.g. a column the caller adds to the frame whose rows it passes); without one it counts as on-policy (0).
    """

    trajectory_id: str
    group_id: str
    step_index: int
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    observation: str

OBSERVATION_FIELD = "{observation}"
TURN_TEMPLATE = "\nState:\n{observation}\nAction:"
"""Text between a response and the next one, as `agents.prompts.build_prompt` renders a history turn (after the
previous action comes "\\nState:\\n", the observation, then "\\nAction:"). Pass your own for other prompt builders."""


class TextTokenizer(Protocol):
    """The slice of a HF tokenizer that `concatenated` uses."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = ..., clean_up_tokenization_spaces: bool = ...
               ) -> str: ...


class RowSpec(NamedTuple):
    """One training sequence before padding; the per-token lists are aligned with input_ids (token p, not shifted)."""

    input_ids: list[int]
    response_mask: list[int]          # 1 on tokens the policy sampled
    observation_mask: list[int]       # 1 on environment-observation tokens between turns (concatenated layout only)
    old_logprobs: list[float]         # rollout log-prob on response tokens, 0.0 elsewhere
    turn_index: list[int]             # k on the response tokens of the row's k-th step, -1 elsewhere
    trajectory_id: str
    group_id: str
    step_indices: tuple[int, ...]     # StepRecord.step_index of the steps the row covers, in order
    has_old_logprobs: bool = True     # False when a step came without rollout log-probs
    advantage: float = 0.0            # broadcast to every response token (set with row._replace(advantage=...))
    step_advantages: tuple[float, ...] = ()  # when set: response tokens of turn k get step_advantages[k] instead
    success: bool = False             # the trajectory succeeded (TrajectoryRecord.won), for SEAL
    staleness: int = 0                # the largest staleness of the steps it covers (0 = on-policy)


def step_rows(steps: Sequence[StepRecord]) -> list[RowSpec]:
    """One RowSpec per step: prompt_ids + response_ids, response_mask 1 on the response ids, no observation mask.

    The step's current observation sits inside its prompt, which is context here, so observation_mask stays 0.
    """
    rows = []
    for step in steps:
        n_prompt, n_response = len(step.prompt_ids), len(step.response_ids)
        logprobs, has_logprobs = _response_logprobs(step)
        rows.append(RowSpec(
            input_ids=list(step.prompt_ids) + list(step.response_ids),
            response_mask=[0] * n_prompt + [1] * n_response,
            observation_mask=[0] * (n_prompt + n_response),
            old_logprobs=[0.0] * n_prompt + logprobs,
            turn_index=[-1] * n_prompt + [0] * n_response,
            trajectory_id=step.trajectory_id,
            group_id=step.group_id,
            step_indices=(step.step_index,),
            has_old_logprobs=has_logprobs,
            staleness=_step_staleness(step),
        ))
    return rows


def concatenated(steps: Sequence[StepRecord], tokenizer: TextTokenizer, *, turn_template: str = TURN_TEMPLATE
                 ) -> RowSpec:
    """One RowSpec for a whole trajectory: prompt_ids[0] + response_ids[0] + between_1 + response_ids[1] + ...

    between_k (the ids after response k-1 and before response k) is, in order of preference:
    1. prefix-consistent history (a full-history context manager whose prompts are extended, not re-rendered):
       when steps[k].prompt_ids starts with steps[k-1].prompt_ids + steps[k-1].response_ids, the rest of
       steps[k].prompt_ids, exactly the ids the policy saw. The observation tokens in it are found by decoding:
       the tokens overlapping the last occurrence of steps[k].observation in the decoded text (none if absent).
    2. otherwise (windowed/no history, or prompts re-tokenized from text, as agents.rollout does, whose prompts never
       contain the eos that ends a response): turn_template rendered around steps[k].observation, each piece encoded
       separately with add_special_tokens=False. This tokenizes environment text and template, never model output;
       the row is then a sequence the policy did not see verbatim, so its log-probs differ from the rollout's
       (recompute old log-probs under the current weights, as models.trainer.rl_update does).
    observation_mask is 1 on the observation tokens of between_k only: never on the initial prompt or template.

    Args: steps of ONE trajectory (any order; sorted by step_index); tokenizer with HF-style encode/decode;
    turn_template: text between turns with one "{observation}" (default: agents.prompts' layout).
    """
    if not steps:
        raise ValueError("concatenated needs at least one step")
    if turn_template.count(OBSERVATION_FIELD) != 1:
        raise ValueError(f"turn_template must contain {OBSERVATION_FIELD!r} exactly once, got {turn_template!r}")
    ordered = sorted(steps, key=lambda s: s.step_index)
    trajectories = {s.trajectory_id for s in ordered}
    if len(trajectories) != 1:
        raise ValueError(f"concatenated builds one trajectory at a time, got steps of {sorted(trajectories)}: "
                         f"group the steps by trajectory_id first")

    ids, response, observation, logprobs, turns = [], [], [], [], []
    has_all_logprobs = True

    def append(piece: Sequence[int], *, is_response: int, obs: Sequence[int], lp: Sequence[float], turn: int) -> None:
        ids.extend(piece)
        response.extend([is_response] * len(piece))
        observation.extend(obs)
        logprobs.extend(lp)
        turns.extend([turn] * len(piece))

    first = ordered[0]
    append(first.prompt_ids, is_response=0, obs=[0] * len(first.prompt_ids), lp=[0.0] * len(first.prompt_ids),
           turn=-1)
    for k, step in enumerate(ordered):
        if k > 0:
            between, between_obs = _between_turns(ordered[k - 1], step, tokenizer, turn_template)
            append(between, is_response=0, obs=between_obs, lp=[0.0] * len(between), turn=-1)
        step_logprobs, has_logprobs = _response_logprobs(step)
        has_all_logprobs = has_all_logprobs and has_logprobs
        append(step.response_ids, is_response=1, obs=[0] * len(step.response_ids), lp=step_logprobs, turn=k)
    return RowSpec(
        input_ids=ids, response_mask=response, observation_mask=observation, old_logprobs=logprobs,
        turn_index=turns, trajectory_id=first.trajectory_id, group_id=first.group_id,
        step_indices=tuple(s.step_index for s in ordered), has_old_logprobs=has_all_logprobs,
        staleness=max(_step_staleness(s) for s in ordered),
    )


def collate_rows(rows: Sequence[RowSpec], pad_id: int) -> dict[str, Tensor]:
    """Right-pads rows into next-token-aligned tensors (L = longest row), like `models.trainer.collate`.

    input_ids, attention_mask [B, L]: the sequences. target_ids[b, t] = input_ids[b, t + 1] (pad at the end).
    response_mask / observation_mask [B, L]: 1 iff target_ids[b, t] is a response / observation token.
    old_logprobs, advantages [B, L]: the target token's rollout log-prob / advantage at response positions, 0 elsewhere
    (advantage: step_advantages[turn] when the row has them, else the row's advantage).
    behaviour_logprobs [B, L]: a copy of old_logprobs, kept when the trainer replaces those by the proximal policy's.
    turn_index [B, L] long: the target token's turn, -1 elsewhere. has_old_logprobs, success [B] bool;
    group_index [B] long: group_id numbered in order of first appearance (AuxInputs.group_index);
    staleness [B] long: the row's staleness.
    """
    if not rows:
        raise ValueError("collate_rows needs at least one row")
    batch, width = len(rows), max(len(r.input_ids) for r in rows)
    input_ids = torch.full((batch, width), pad_id, dtype=torch.long)        # [B, L]
    attention_mask = torch.zeros((batch, width), dtype=torch.long)          # [B, L]
    response_mask = torch.zeros((batch, width), dtype=torch.float32)        # [B, L]
    observation_mask = torch.zeros((batch, width), dtype=torch.float32)     # [B, L]
    old_logprobs = torch.zeros((batch, width), dtype=torch.float32)         # [B, L]
    advantages = torch.zeros((batch, width), dtype=torch.float32)           # [B, L]
    turn_index = torch.full((batch, width), -1, dtype=torch.long)           # [B, L]
    group_numbers: dict[str, int] = {}
    for b, row in enumerate(rows):
        n = len(row.input_ids)
        _check_row(b, row)
        input_ids[b, :n] = torch.tensor(row.input_ids, dtype=torch.long)
        attention_mask[b, :n] = 1
        shifted = slice(0, n - 1)                                           # logits at t predict token t + 1
        resp = torch.tensor(row.response_mask[1:], dtype=torch.float32)     # [n - 1]
        turns = torch.tensor(row.turn_index[1:], dtype=torch.long)          # [n - 1]
        response_mask[b, shifted] = resp
        observation_mask[b, shifted] = torch.tensor(row.observation_mask[1:], dtype=torch.float32)
        old_logprobs[b, shifted] = torch.tensor(row.old_logprobs[1:], dtype=torch.float32) * resp
        turn_index[b, shifted] = torch.where(resp.bool(), turns, torch.full_like(turns, -1))
        if row.step_advantages:
            per_turn = torch.tensor(row.step_advantages, dtype=torch.float32)  # [T]
            advantages[b, shifted] = torch.where(resp.bool(), per_turn[turns.clamp_min(0)], torch.zeros_like(resp))
        else:
            advantages[b, shifted] = float(row.advantage) * resp
        group_numbers.setdefault(row.group_id, len(group_numbers))
    target_ids = torch.cat([input_ids[:, 1:], torch.full((batch, 1), pad_id, dtype=torch.long)], dim=1)  # [B, L]
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "target_ids": target_ids,
        "response_mask": response_mask,
        "observation_mask": observation_mask,
        "old_logprobs": old_logprobs,
        "behaviour_logprobs": old_logprobs.clone(),
        "advantages": advantages,
        "turn_index": turn_index,
        "has_old_logprobs": torch.tensor([r.has_old_logprobs for r in rows], dtype=torch.bool),   # [B]
        "success": torch.tensor([r.success for r in rows], dtype=torch.bool),                     # [B]
        "group_index": torch.tensor([group_numbers[r.group_id] for r in rows], dtype=torch.long),  # [B]
        "staleness": torch.tensor([check_staleness(r.staleness, f"row {b} ({r.trajectory_id})")
                                   for b, r in enumerate(rows)], dtype=torch.long),                 # [B]
    }


# --------------------------------------------------------------------------------------------------- helpers
def _response_logprobs(step: StepRecord) -> tuple[list[float], bool]:
    """(the step's rollout log-probs, whether it had them); zeros when the record carries none."""
    n_response = len(step.response_ids)
    if len(step.logprobs) == n_response:
        return [float(x) for x in step.logprobs], True
    if not step.logprobs:
        return [0.0] * n_response, False
    raise ValueError(f"step {step.step_index} of {step.trajectory_id}: {len(step.logprobs)} log-probs for "
                     f"{n_response} response ids; the record is corrupt, drop it or re-run the rollout")


def _between_turns(prev: StepRecord, cur: StepRecord, tokenizer: TextTokenizer, turn_template: str
                   ) -> tuple[list[int], list[int]]:
    """(ids between prev's response and cur's response, their observation mask); see `concatenated`."""
    history = list(prev.prompt_ids) + list(prev.response_ids)
    if list(cur.prompt_ids[: len(history)]) == history:
        between = list(cur.prompt_ids[len(history):])
        return between, _observation_positions(between, cur.observation, tokenizer)
    before, _, after = turn_template.partition(OBSERVATION_FIELD)
    pieces = [(_encode(tokenizer, before), 0), (_encode(tokenizer, cur.observation), 1), (_encode(tokenizer, after), 0)]
    return [i for ids, _ in pieces for i in ids], [flag for ids, flag in pieces for _ in ids]


def _step_staleness(step: StepRecord) -> int:
    """The step's ``staleness`` when it carries one (see StepRecord), else 0 (on-policy)."""
    return check_staleness(getattr(step, "staleness", 0), f"step {step.step_index} of {step.trajectory_id}")


def _encode(tokenizer: TextTokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False)) if text else []


def _decode(tokenizer: TextTokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _observation_positions(ids: list[int], observation: str, tokenizer: TextTokenizer) -> list[int]:
    """1 on the tokens of `ids` whose decoded text overlaps the last occurrence of `observation` (or of its strip)."""
    mask = [0] * len(ids)
    text = _decode(tokenizer, ids)
    for target in (observation, observation.strip()):
        start = text.rfind(target) if target.strip() else -1
        if start >= 0:
            break
    else:
        return mask
    end = start + len(target)

    def prefix_chars(k: int) -> int:                                        # decoded length of the first k tokens
        return len(_decode(tokenizer, ids[:k]))

    # token i spans [prefix_chars(i), prefix_chars(i + 1)); binary searches keep this O(log n) decodes
    first = _first_true(lambda k: prefix_chars(k) > start, 1, len(ids)) - 1
    last = _first_true(lambda k: prefix_chars(k) >= end, 0, len(ids)) - 1
    for i in range(first, last + 1):
        mask[i] = 1
    return mask


def _first_true(predicate: Callable[[int], bool], lo: int, hi: int) -> int:
    """Smallest k in [lo, hi] with predicate(k), for a predicate monotone in k and true at hi."""
    while lo < hi:
        mid = (lo + hi) // 2
        if predicate(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _check_row(b: int, row: RowSpec) -> None:
    n = len(row.input_ids)
    if n == 0:
        raise ValueError(f"row {b} ({row.trajectory_id}) is empty")
    lengths = {name: len(getattr(row, name)) for name in ("response_mask", "observation_mask", "old_logprobs",
                                                          "turn_index")}
    if any(length != n for length in lengths.values()):
        raise ValueError(f"row {b} ({row.trajectory_id}): per-token lists {lengths} must all have len(input_ids) = {n}")
    if row.response_mask[0]:
        raise ValueError(f"row {b} ({row.trajectory_id}) starts with a response token: it would have no context "
                         f"(empty prompt)")
    if row.step_advantages and max(row.turn_index) >= len(row.step_advantages):
        raise ValueError(f"row {b} ({row.trajectory_id}): {len(row.step_advantages)} step_advantages for "
                         f"{max(row.turn_index) + 1} turns")
