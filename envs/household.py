"""Household: procedurally generated ALFWorld-style homes as a text env (world and expert in envs/household_world.py).

A home has ``rooms`` rooms (kitchen, living room, bedroom, bathroom) full of numbered receptacles and objects; the
task is one of ALFWorld's six types and, as in ALFWorld, names a receptacle type, e.g. ``Your task is to: put a
clean plate in shelf.``: any shelf takes the win. Actions (ALFWorld's language)::

    go to <recep>   open <recep>   close <recep>   take <obj> from <recep>   put <obj> in <recep>
    clean <obj> with <sinkbasin>   heat <obj> with <microwave>   cool <obj> with <fridge>
    use <desklamp>   examine <obj>   examine <recep>   look   inventory

``go to`` reaches any receptacle of the home in one step (as in ALFWorld); observations say which room it is in.
``rooms=1`` (kwarg or reset option) is ALFWorld's scene shape: one room, every receptacle one ``go to`` away, no
other room in any text. Closed cabinets, drawers, fridges and microwaves hide their contents until opened (``examine
<recep>`` at a closed one says so). ``use`` toggles a desk lamp on and off; a look task is won only while a lamp is
on where the agent holds the object. The agent carries one object. tests/envs/test_household.py checks the rules
against ALFWorld's PDDL preconditions and effects.
An action is valid iff it is in ``info["admissible_actions"]``; anything else is an invalid action (state unchanged,
reward ``-invalid_penalty``, the step still counts); case, extra spaces, a final period and ``put x on y`` are
forgiven. Reward 1.0 when the task is done (terminated, ``won``). ``info["subgoals_done"]`` is the running maximum
of the progress the state shows (e.g. take, heat, put), so it never decreases. The anchor is
``<world id>|<location>|<held>|<hash of object places and states, open receptacles, lit lamps>``.
Splits (``options["split"]``): see envs/household_world.py.
Scenario key (``scenario_key``): the whole world (rooms, templates, receptacles, lamps, where every object starts,
hidden ones included, the start room, the task) and the step limit, not the first observation, which shows neither
the objects nor, in ``short`` verbosity, the task.
Pure module: no Prefect, MLflow, DVC or file I/O.
"""
from __future__ import annotations

import hashlib
import re

from envs import household_world as hw
from envs.base import check_reset_options, register_env
from envs.household_world import State, World, is_open, rtype

RESET_OPTIONS: tuple[str, ...] = ("rooms", "distractors", "max_steps", "task_type", "split")
VERBOSITIES: tuple[str, ...] = ("short", "full")
_TASK_ADJECTIVE = {"clean": "clean", "heat": "hot", "cool": "cool"}  # ALFWorld's goal words ("put a cool apple in")
_PUT_ON = re.compile(r"^(put \w+ \d+) on ")
_PARSE = re.compile(r"^(?:(go to|open|close|use|examine) (\w+ \d+)|(take) (\w+ \d+) from (\w+ \d+)"
                    r"|(put) (\w+ \d+) (?:in|on) (\w+ \d+)|(clean|heat|cool) (\w+ \d+) with (\w+ \d+))$")


# --------------------------------------------------------------------------------------------------- text
def _join(names: list[str]) -> str:
    return ", ".join(names) if names else "nothing"


def contents(world: World, state: State, recep: str) -> list[str]:
    """Lamps and objects on/in ``recep`` (regardless of whether it is open)."""
    lamps = [lamp for lamp, host in world.lamps.items() if host == recep]
    return lamps + sorted(o for o, r in state.where.items() if r == recep)


def _inside(world: World, state: State, recep: str) -> str:
    """``In it: egg 1.`` / ``On it: nothing.``, or ``The fridge 1 is closed.``"""
    if not is_open(state, recep):
        return f"The {recep} is closed."
    word = "In" if rtype(recep) in hw.OPENABLE or rtype(recep) in ("sinkbasin", "garbagecan") else "On"
    return f"{word} it: {_join(contents(world, state, recep))}."


def describe_location(world: World, state: State) -> str:
    """``You are in the kitchen at fridge 1. In it: egg 1.`` (or the room overview when at no receptacle)."""
    if state.loc is None:
        return room_overview(world, state)
    return f"You are in the {world.recep_room[state.loc]} at {state.loc}. {_inside(world, state, state.loc)}"


def _compress(names: list[str]) -> str:
    """``cabinet 1, cabinet 2, cabinet 3, fridge 1`` -> ``cabinet 1-3, fridge 1``."""
    groups: dict[str, list[int]] = {}
    for name in names:
        groups.setdefault(rtype(name), []).append(int(name.rsplit(" ", 1)[1]))
    parts = []
    for kind, nums in sorted(groups.items()):
        lo, hi = min(nums), max(nums)
        parts.append(f"{kind} {lo}-{hi}" if len(nums) > 1 and hi - lo + 1 == len(nums)
                     else ", ".join(f"{kind} {n}" for n in nums))
    return ", ".join(parts)


def room_receptacles(world: World, room: str) -> str:
    """The receptacles of ``room``, compressed: ``cabinet 1-3, countertop 1, fridge 1``."""
    return _compress([r for r in world.receptacles if world.recep_room[r] == room])


def room_overview(world: World, state: State, *, all_rooms: bool = False) -> str:
    """The agent's room and what is in it; the other rooms by name (``all_rooms``: with their receptacles)."""
    head = f"You are in the middle of the {state.room}. Around you: {room_receptacles(world, state.room)}."
    others = [r for r in world.rooms if r != state.room]
    if all_rooms:
        return "\n".join([head] + [f"In the {r}: {room_receptacles(world, r)}." for r in others])
    return f"{head} Other rooms: {', '.join(others)}." if others else head


def examine_text(world: World, state: State, thing: str) -> str:
    """What ``examine`` says of a receptacle (its contents, if open), a lamp (on or off) or an object (its state)."""
    if thing in world.recep_room:
        is_openable_and_open = rtype(thing) in hw.OPENABLE and thing in state.opened
        return " ".join([f"You examine the {thing}.", *([f"The {thing} is open."] if is_openable_and_open else []),
                         _inside(world, state, thing)])
    if thing in world.lamps:
        return f"The {thing} is {'on' if thing in state.lamps_on else 'off'}."
    obj = thing
    words = [hw.STATE_WORD[p] for p in ("clean", "heat", "cool") if obj in state.states[p]]
    if state.held == obj and hw.lit_here(world, state):
        return f"You examine the {obj} under the desklamp light."
    return f"The {obj} is {' and '.join(words)}." if words else f"This is a normal {obj}."


# --------------------------------------------------------------------------------------------------- dynamics
def admissible_actions(world: World, state: State) -> list[str]:
    """Every action that does something now, sorted."""
    actions = ["inventory", "look"] + [f"go to {r}" for r in world.receptacles if r != state.loc]
    held, loc = state.held, state.loc
    if held is not None:
        actions.append(f"examine {held}")
    if loc is not None:
        kind = rtype(loc)
        actions.append(f"examine {loc}")
        if kind in hw.OPENABLE:
            actions.append(f"{'close' if loc in state.opened else 'open'} {loc}")
        if is_open(state, loc):
            for obj in (o for o, r in state.where.items() if r == loc):
                actions.append(f"examine {obj}")
                if held is None:
                    actions.append(f"take {obj} from {loc}")
            if held is not None:
                actions.append(f"put {held} in {loc}")
        process = hw.PROCESS_AT.get(kind)
        if held is not None and process and hw.supports(rtype(held), process):
            actions.append(f"{process} {held} with {loc}")
        for lamp in (lamp for lamp, host in world.lamps.items() if host == loc):
            actions += [f"use {lamp}", f"examine {lamp}"]
    return sorted(actions)


def apply_action(world: World, state: State, action: str) -> str:
    """Carry out an admissible ``action`` on ``state`` (in place); the observation it gives."""
    if action == "look":
        return describe_location(world, state)
    if action == "inventory":
        return f"You are carrying: {state.held}." if state.held else "You are not carrying anything."
    groups = [g for g in _PARSE.match(action).groups() if g is not None]
    verb, args = groups[0], groups[1:]
    if verb == "go to":
        state.loc = args[0]
        state.room = world.recep_room[args[0]]
        return describe_location(world, state)
    if verb == "open":
        state.opened.add(args[0])
        return f"You open the {args[0]}. In it: {_join(contents(world, state, args[0]))}."
    if verb == "close":
        state.opened.discard(args[0])
        return f"You close the {args[0]}."
    if verb == "take":
        state.held, state.where[args[0]] = args[0], None
        return f"You pick up the {args[0]} from the {args[1]}."
    if verb == "put":
        state.held, state.where[args[0]] = None, args[1]
        return f"You put the {args[0]} in the {args[1]}."
    if verb == "use":  # a toggle, as ALFWorld's ToggleObject
        state.lamps_on ^= {args[0]}
        return f"You turn {'on' if args[0] in state.lamps_on else 'off'} the {args[0]}."
    if verb == "examine":
        return examine_text(world, state, args[0])
    obj = args[0]  # clean / heat / cool: heat and cool undo each other
    state.states[verb].add(obj)
    opposite = {"heat": "cool", "cool": "heat"}.get(verb)
    if opposite:
        state.states[opposite].discard(obj)
    return f"You {verb} the {obj} using the {args[1]}."


def invalid_reason(world: World, state: State, action: str) -> str:
    """Why a non-admissible action does nothing, in a short sentence."""
    match = _PARSE.match(action)
    if match is None:
        return "Nothing happens. Valid actions look like: go to <recep>, take <obj> from <recep>, look."
    groups = [g for g in match.groups() if g is not None]
    verb, args = groups[0], groups[1:]
    recep = None if verb in ("examine", "use") else args[-1]
    if verb == "examine" and args[0] in world.recep_room:
        recep = args[0]
    if recep is not None and recep not in world.receptacles:
        return f"Nothing happens. There is no {recep} in this home."
    if verb == "go to":
        return f"Nothing happens. You are already at the {recep}."
    if recep is not None and recep != state.loc:
        return f"Nothing happens. Go to the {recep} first."
    if verb in ("open", "close"):
        if rtype(recep) not in hw.OPENABLE:
            return f"Nothing happens. The {recep} cannot be opened or closed."
        return f"Nothing happens. The {recep} is already {'open' if recep in state.opened else 'closed'}."
    if verb in ("take", "put") and not is_open(state, recep):
        return f"Nothing happens. The {recep} is closed."
    if verb == "take" and state.held is not None:
        return f"Nothing happens. You can carry one object; put the {state.held} down first."
    if verb in ("put", "clean", "heat", "cool") and state.held != args[0]:
        return f"Nothing happens. You are not carrying the {args[0]}."
    return "Nothing happens."


def state_anchor(world: World, state: State) -> str:
    """``<world_id>|<location>|<held>|<hash of object places, open receptacles, object states, lamps>``."""
    dynamic = repr((sorted(state.where.items(), key=lambda kv: kv[0]), sorted(state.opened),
                    [sorted(state.states[p]) for p in ("clean", "heat", "cool")], sorted(state.lamps_on)))
    digest = hashlib.sha1(dynamic.encode()).hexdigest()[:8]
    return f"{world.world_id}|{state.loc or state.room}|{state.held or '-'}|{digest}"


# --------------------------------------------------------------------------------------------------- env
def _check_knobs(rooms: int, distractors: int, max_steps: int, task_type: str | None) -> None:
    if not 1 <= rooms <= len(hw.ROOM_TYPES):
        raise ValueError(f"household: rooms must be in 1..{len(hw.ROOM_TYPES)}, got {rooms}")
    if distractors < 0:
        raise ValueError(f"household: distractors must be >= 0, got {distractors}")
    if max_steps < 1:
        raise ValueError(f"household: max_steps must be >= 1, got {max_steps}")
    if task_type is not None and task_type not in hw.TASK_TYPES:
        raise ValueError(f"household: unknown task_type {task_type!r}; valid: {list(hw.TASK_TYPES)} or None "
                         f"(drawn from the seed)")


@register_env("household")
class HouseholdText:
    """ALFWorld-style household tasks behind the text-env contract (see envs/base.py and the module docstring).

    Info beyond the contract: ``admissible_actions``, ``subgoals`` (names), ``subgoals_done`` / ``subgoals_total``,
    ``task_type``, ``room`` (the agent's room), ``world_id``, ``split``, ``steps``.
    """

    split_aware = True

    def __init__(self, rooms: int = 2, distractors: int = 3, max_steps: int = 30, task_type: str | None = None,
                 invalid_penalty: float = 0.0, verbosity: str = "short") -> None:
        _check_knobs(int(rooms), int(distractors), int(max_steps), task_type)
        if verbosity not in VERBOSITIES:
            raise ValueError(f"household: verbosity must be one of {list(VERBOSITIES)}, got {verbosity!r}")
        self.rooms, self.distractors, self.max_steps = int(rooms), int(distractors), int(max_steps)
        self.task_type = task_type
        self.invalid_penalty = float(invalid_penalty)
        self.verbosity = verbosity
        self.world: World | None = None
        self.state: State | None = None
        self.split = "train"
        self._episode_max_steps = self.max_steps
        self._steps = 0
        self._done = True
        self._won = False
        self._subgoals_done = 0
        self._admissible: list[str] = []

    # ----------------------------------------------------------------------------------------- contract
    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        options = check_reset_options("household", options, RESET_OPTIONS)
        split = options.get("split", "train")
        rooms = int(options.get("rooms", self.rooms))
        distractors = int(options.get("distractors", self.distractors))
        max_steps = int(options.get("max_steps", self.max_steps))
        task_type = options.get("task_type", self.task_type)
        _check_knobs(rooms, distractors, max_steps, task_type)
        world = hw.generate_world(seed, rooms=rooms, distractors=distractors, task_type=task_type, split=split)
        return self.reset_to_world(world, split=split, max_steps=max_steps)

    def reset_to_world(self, world: World, *, split: str = "train", max_steps: int | None = None
                       ) -> tuple[str, dict]:
        """Start an episode in a given world (a hand-built one in tests, or one from ``generate_world``)."""
        self.world, self.state = world, hw.initial_state(world)
        self.split, self._episode_max_steps = split, self.max_steps if max_steps is None else int(max_steps)
        self._steps, self._done, self._won = 0, False, False
        self._subgoals_done = hw.progress(world, self.state)
        obs = room_overview(self.world, self.state, all_rooms=self.verbosity == "full")
        if self.verbosity == "full":
            obs = f"{self.task_description()}\n{obs}"
        return obs, self._info(action_valid=True)

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        if self.world is None:
            raise RuntimeError("household: step() before reset(); call reset(seed=...) first")
        if self._done:
            raise RuntimeError("household: the episode is over; call reset() before stepping again")
        text = " ".join(action.strip().lower().rstrip(".").split()) if isinstance(action, str) else ""
        text = _PUT_ON.sub(r"\1 in ", text)  # "put x 1 on y 1" is the same action as "put x 1 in y 1"
        self._steps += 1
        valid = text in self._admissible
        if valid:
            obs = apply_action(self.world, self.state, text)
            self._won = hw.is_won(self.world, self.state)
            self._subgoals_done = max(self._subgoals_done, hw.progress(self.world, self.state))
            reward = 1.0 if self._won else 0.0
        else:
            obs = invalid_reason(self.world, self.state, text)
            reward = 0.0 - self.invalid_penalty
        if self.verbosity == "full":
            obs += f" You carry: {self.state.held or 'nothing'}."
        terminated = self._won
        truncated = not terminated and self._steps >= self._episode_max_steps
        self._done = terminated or truncated
        return obs, reward, terminated, truncated, self._info(action_valid=valid)

    def task_description(self) -> str:
        if self.world is None:
            return "Your task is to: (call reset first)."
        task = self.world.task
        obj = task.obj_type
        if task.task_type == "look_at_obj_in_light":
            return f"Your task is to: examine the {obj} with the desklamp."
        if task.task_type == "pick_two_obj_and_place":
            return f"Your task is to: put two {obj} in {task.target_type}."
        adjective = f"{_TASK_ADJECTIVE[task.process]} " if task.process else ""
        article = "an" if (adjective or obj)[0] in "aeiou" else "a"
        return f"Your task is to: put {article} {adjective}{obj} in {task.target_type}."

    def expert_action(self) -> str | None:
        """Next action of the omniscient planner from the current state; None before reset or once done."""
        if self.world is None or self._done:
            return None
        return hw.expert_action(self.world, self.state)

    def scenario_key(self) -> str:
        """The episode's world and step limit (module docstring), read right after ``reset``."""
        if self.world is None:
            raise RuntimeError("household: scenario_key() before reset(); call reset(seed=...) first")
        world = self.world
        return repr((world.rooms, world.templates, world.receptacles, sorted(world.recep_room.items()),
                     sorted(world.lamps.items()), sorted(world.initial.items()), world.start_room, world.task,
                     self._episode_max_steps))

    # ----------------------------------------------------------------------------------------- helpers
    def _info(self, *, action_valid: bool) -> dict:
        self._admissible = [] if self._done else admissible_actions(self.world, self.state)
        names = hw.subgoal_names(self.world.task)
        return {
            "anchor": state_anchor(self.world, self.state),
            "action_valid": action_valid,
            "won": self._won,
            "admissible_actions": list(self._admissible),
            "subgoals": names,
            "subgoals_done": self._subgoals_done,
            "subgoals_total": len(names),
            "task_type": self.world.task.task_type,
            "room": self.state.room,
            "world_id": self.world.world_id,
            "split": self.split,
            "steps": self._steps,
        }
