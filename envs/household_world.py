"""World of the ``household`` env: the catalog, home generation, the seen/unseen split, task progress and the expert.

A home is a few rooms (always in ``ROOM_TYPES`` order), each built from a layout template: a list of receptacle
types with count ranges. Receptacles and objects are numbered per type across the whole home (``cabinet 1`` ..
``cabinet 5`` may span the kitchen and the bathroom). A desk lamp stands on the bedroom's desk and on the living
room's side table. Movement is ALFWorld's: ``go to`` reaches any receptacle of the home in one step; rooms only say
where a receptacle is. A one-room home is ALFWorld's scene shape (one room, no room in the text but its name).

Goals are ALFWorld's: a task names a receptacle *type* (``put a vase in shelf``) and any receptacle of that type
takes the win; two objects (pick_two) must share one receptacle. Task objects never start in a target-type
receptacle, so no task is won at the start.

Splits, like ALFWorld's seen/unseen: the (object type, target receptacle type) pairs are partitioned once, by a
fixed hash (``"desklamp"`` is the target type of look tasks); in each target type's group, sorted by that hash, every
5th pair from the 3rd on is unseen. The last layout template of every room type is unseen too. ``train`` homes use
only seen pairs and templates, ``heldout`` homes only unseen ones.
Pure module: no Prefect, MLflow, DVC or file I/O.
"""
from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

ROOM_TYPES: tuple[str, ...] = ("kitchen", "living room", "bedroom", "bathroom")
OPENABLE = frozenset({"cabinet", "drawer", "fridge", "microwave"})
TASK_TYPES: tuple[str, ...] = ("pick_and_place", "look_at_obj_in_light", "pick_clean_then_place",
                               "pick_heat_then_place", "pick_cool_then_place", "pick_two_obj_and_place")
PROCESS_OF_TASK = {"pick_clean_then_place": "clean", "pick_heat_then_place": "heat", "pick_cool_then_place": "cool"}
APPLIANCE_OF = {"clean": "sinkbasin", "heat": "microwave", "cool": "fridge"}  # process -> receptacle type
PROCESS_AT = {recep: process for process, recep in APPLIANCE_OF.items()}
STATE_WORD = {"clean": "clean", "heat": "hot", "cool": "cold"}  # process -> object state it leaves
ROOMS_FOR_TASK = {"pick_heat_then_place": ("kitchen",), "pick_cool_then_place": ("kitchen",),
                  "pick_clean_then_place": ("kitchen", "bathroom"),
                  "look_at_obj_in_light": ("living room", "bedroom")}  # a room the task's appliance is in
LAMP_HOST = {"bedroom": "desk", "living room": "sidetable"}
LAMP_TARGET = "desklamp"
HELDOUT_TEMPLATE = 3  # index of the unseen template of every room type
NOT_TARGETS = frozenset({"sinkbasin", "microwave", "fridge"})  # appliances are never place targets

# Layout templates: (receptacle type, min count, max count). Index HELDOUT_TEMPLATE is the unseen one.
TEMPLATES: dict[str, tuple[tuple[tuple[str, int, int], ...], ...]] = {
    "kitchen": (
        (("countertop", 1, 2), ("cabinet", 2, 4), ("drawer", 1, 3), ("fridge", 1, 1), ("microwave", 1, 1),
         ("sinkbasin", 1, 1), ("garbagecan", 1, 1)),
        (("countertop", 2, 3), ("cabinet", 3, 5), ("fridge", 1, 1), ("microwave", 1, 1), ("sinkbasin", 1, 1),
         ("diningtable", 1, 1), ("shelf", 1, 2)),
        (("countertop", 1, 1), ("cabinet", 2, 3), ("drawer", 2, 3), ("fridge", 1, 1), ("microwave", 1, 1),
         ("sinkbasin", 1, 1), ("diningtable", 1, 1), ("garbagecan", 1, 1)),
        (("countertop", 1, 2), ("cabinet", 1, 2), ("drawer", 1, 1), ("fridge", 1, 1), ("microwave", 1, 1),
         ("sinkbasin", 1, 1), ("shelf", 2, 3), ("diningtable", 1, 1), ("garbagecan", 1, 1)),
    ),
    "living room": (
        (("sofa", 1, 1), ("coffeetable", 1, 1), ("sidetable", 1, 1), ("shelf", 1, 2), ("drawer", 1, 2),
         ("garbagecan", 1, 1)),
        (("sofa", 1, 1), ("armchair", 1, 1), ("sidetable", 1, 2), ("tvstand", 1, 1), ("cabinet", 1, 2)),
        (("sofa", 1, 2), ("coffeetable", 1, 1), ("sidetable", 1, 1), ("shelf", 2, 3), ("dresser", 1, 1)),
        (("armchair", 1, 2), ("coffeetable", 1, 1), ("sidetable", 1, 1), ("drawer", 2, 3), ("shelf", 1, 1),
         ("tvstand", 1, 1), ("garbagecan", 1, 1)),
    ),
    "bedroom": (
        (("bed", 1, 1), ("desk", 1, 1), ("drawer", 2, 4), ("shelf", 1, 2), ("garbagecan", 1, 1)),
        (("bed", 1, 1), ("desk", 1, 1), ("dresser", 1, 1), ("sidetable", 1, 1), ("drawer", 1, 2)),
        (("bed", 1, 1), ("desk", 1, 1), ("shelf", 2, 3), ("cabinet", 1, 2), ("garbagecan", 1, 1)),
        (("bed", 1, 1), ("desk", 1, 1), ("dresser", 1, 1), ("drawer", 1, 2), ("shelf", 1, 2), ("sidetable", 1, 1)),
    ),
    "bathroom": (
        (("sinkbasin", 1, 1), ("countertop", 1, 1), ("cabinet", 2, 3), ("towelholder", 1, 1), ("toilet", 1, 1),
         ("garbagecan", 1, 1)),
        (("sinkbasin", 1, 2), ("cabinet", 1, 2), ("drawer", 1, 2), ("towelholder", 1, 1), ("toilet", 1, 1)),
        (("sinkbasin", 1, 1), ("countertop", 1, 1), ("shelf", 1, 2), ("toilet", 1, 1), ("garbagecan", 1, 1)),
        (("sinkbasin", 1, 1), ("cabinet", 2, 4), ("drawer", 1, 1), ("shelf", 1, 1), ("toilet", 1, 1),
         ("towelholder", 1, 1)),
    ),
}

# Object type -> (receptacle types it is found in, what it supports: c=clean, h=heat, k=cool, l=look in light)
OBJECTS: dict[str, tuple[tuple[str, ...], str]] = {
    "apple": (("countertop", "fridge", "diningtable", "garbagecan"), "chk"),
    "tomato": (("countertop", "fridge", "diningtable", "garbagecan"), "chk"),
    "potato": (("countertop", "fridge", "diningtable", "cabinet", "garbagecan"), "chk"),
    "egg": (("fridge", "countertop", "diningtable", "microwave"), "hk"),
    "bread": (("countertop", "diningtable", "fridge", "cabinet"), "hk"),
    "lettuce": (("fridge", "countertop", "diningtable"), "ck"),
    "mug": (("cabinet", "countertop", "shelf", "diningtable", "desk", "coffeetable", "sinkbasin", "microwave"),
            "chkl"),
    "plate": (("cabinet", "countertop", "shelf", "diningtable", "sinkbasin"), "chk"),
    "bowl": (("cabinet", "countertop", "shelf", "diningtable", "fridge"), "chkl"),
    "cup": (("cabinet", "countertop", "shelf", "fridge", "sinkbasin", "microwave"), "chk"),
    "pan": (("countertop", "cabinet", "sinkbasin"), "ck"),
    "knife": (("countertop", "drawer", "diningtable", "sinkbasin"), "c"),
    "spoon": (("drawer", "countertop", "diningtable", "sinkbasin"), "c"),
    "fork": (("drawer", "countertop", "diningtable"), "c"),
    "winebottle": (("fridge", "countertop", "cabinet", "shelf", "diningtable"), "k"),
    "book": (("shelf", "desk", "bed", "sofa", "coffeetable", "sidetable", "dresser", "drawer"), "l"),
    "cd": (("shelf", "desk", "drawer", "tvstand", "dresser", "sidetable", "cabinet"), "l"),
    "pencil": (("desk", "drawer", "shelf", "sidetable"), "l"),
    "pen": (("desk", "drawer", "shelf", "sidetable", "dresser"), "l"),
    "cellphone": (("bed", "desk", "sofa", "sidetable", "dresser", "drawer", "armchair"), "l"),
    "keychain": (("drawer", "sidetable", "coffeetable", "dresser", "shelf", "desk"), "l"),
    "creditcard": (("drawer", "desk", "sidetable", "dresser", "coffeetable", "countertop"), "l"),
    "remotecontrol": (("sofa", "coffeetable", "tvstand", "armchair", "sidetable"), "l"),
    "pillow": (("bed", "sofa", "armchair"), "l"),
    "alarmclock": (("desk", "sidetable", "shelf", "dresser"), "l"),
    "vase": (("shelf", "coffeetable", "sidetable", "tvstand", "dresser", "diningtable"), "l"),
    "newspaper": (("sofa", "coffeetable", "sidetable", "armchair", "diningtable"), "l"),
    "towel": (("towelholder", "countertop", "cabinet", "shelf"), "c"),
    "soapbar": (("sinkbasin", "countertop", "cabinet", "toilet"), "c"),
    "spraybottle": (("cabinet", "toilet", "countertop", "shelf", "garbagecan"), ""),
    "toiletpaper": (("toilet", "cabinet", "countertop", "drawer", "shelf", "garbagecan"), ""),
    "candle": (("shelf", "countertop", "toilet", "cabinet", "sidetable", "coffeetable"), ""),
}
_SUPPORT_LETTER = {"clean": "c", "heat": "h", "cool": "k", "look": "l"}


def rtype(name: str) -> str:
    """Type of a numbered thing: ``"cabinet 2" -> "cabinet"``."""
    return name.rsplit(" ", 1)[0]


def supports(obj_type: str, process: str) -> bool:
    """Whether objects of ``obj_type`` can be ``process``-ed (clean, heat, cool) or looked at in light (look)."""
    return _SUPPORT_LETTER[process] in OBJECTS[obj_type][1]


def task_combos(task_type: str) -> list[tuple[str, str]]:
    """Every (object type, target type) pair a task type can ask for, sorted."""
    if task_type == "look_at_obj_in_light":
        return sorted((o, LAMP_TARGET) for o in OBJECTS if supports(o, "look"))
    process = PROCESS_OF_TASK.get(task_type)
    return sorted((o, r) for o, (found, _) in OBJECTS.items() for r in found
                  if r not in NOT_TARGETS and (process is None or supports(o, process)))


def _combo_hash(combo: tuple[str, str]) -> str:
    return hashlib.sha1(f"{combo[0]}|{combo[1]}".encode()).hexdigest()


def _unseen_combos() -> frozenset[tuple[str, str]]:
    all_combos = {c for t in TASK_TYPES for c in task_combos(t)}
    unseen = set()
    for target in sorted({r for _, r in all_combos}):
        group = sorted((c for c in all_combos if c[1] == target), key=_combo_hash)
        unseen.update(c for rank, c in enumerate(group) if rank % 5 == 2)
    return frozenset(unseen)


UNSEEN_COMBOS: frozenset[tuple[str, str]] = _unseen_combos()


def combo_split(obj_type: str, target_type: str) -> str:
    """``"heldout"`` for an unseen (object type, target type) pair, ``"train"`` for a seen one."""
    return "heldout" if (obj_type, target_type) in UNSEEN_COMBOS else "train"


@dataclass(frozen=True)
class Task:
    """What to achieve: ``count`` objects of ``obj_type``, ``process``-ed, in one receptacle of ``target_type``
    (any of them), or an ``obj_type`` object held at a lit desk lamp."""

    task_type: str
    obj_type: str
    target_type: str  # receptacle type, or "desklamp" for look_at_obj_in_light
    count: int
    process: str | None  # "clean" | "heat" | "cool" | None


@dataclass(frozen=True)
class World:
    """The static part of an episode: rooms, receptacles, lamps, the initial object placement, the task."""

    world_id: str
    rooms: tuple[str, ...]
    templates: tuple[int, ...]  # template index per room
    receptacles: tuple[str, ...]  # in room order
    recep_room: dict[str, str]
    lamps: dict[str, str]  # lamp -> receptacle it stands on
    initial: dict[str, str]  # object -> receptacle
    start_room: str
    task: Task


@dataclass
class State:
    """The dynamic part: where the agent is, what it holds, where objects are, what is open, hot, lit..."""

    room: str
    loc: str | None  # receptacle the agent is at; None in the middle of a room (start)
    held: str | None
    where: dict[str, str | None]  # object -> receptacle (None while held)
    opened: set[str]
    states: dict[str, set[str]]  # process -> objects in that state ("clean", "heat", "cool")
    lamps_on: set[str]


def initial_state(world: World) -> State:
    return State(room=world.start_room, loc=None, held=None, where=dict(world.initial), opened=set(),
                 states={p: set() for p in APPLIANCE_OF}, lamps_on=set())


def _choose_home(rng: random.Random, task_type: str, n_rooms: int, split: str) -> tuple[list[str], list[int]]:
    first = rng.choice(ROOMS_FOR_TASK.get(task_type, ROOM_TYPES))
    others = rng.sample([r for r in ROOM_TYPES if r != first], n_rooms - 1)
    rooms = sorted([first, *others], key=ROOM_TYPES.index)
    templates = [HELDOUT_TEMPLATE if split == "heldout" else rng.randrange(HELDOUT_TEMPLATE) for _ in rooms]
    return rooms, templates


def _build_receptacles(rng: random.Random, rooms: list[str], templates: list[int]) -> dict[str, str]:
    """Receptacle name -> room, numbered per type across the home in room order."""
    counters: dict[str, int] = {}
    recep_room: dict[str, str] = {}
    for room, template in zip(rooms, templates):
        for recep_type, lo, hi in TEMPLATES[room][template]:
            for _ in range(rng.randint(lo, hi)):
                counters[recep_type] = counters.get(recep_type, 0) + 1
                recep_room[f"{recep_type} {counters[recep_type]}"] = room
    return recep_room


def _feasible(combo: tuple[str, str], type_counts: dict[str, int], has_lamp: bool) -> bool:
    """The home has the target type (or a lamp) and a place for the object outside every target-type receptacle."""
    obj_type, target_type = combo
    starts = sum(type_counts.get(r, 0) for r in OBJECTS[obj_type][0] if r != target_type)
    if target_type == LAMP_TARGET:
        return has_lamp and starts > 0
    return target_type in type_counts and starts > 0


def generate_world(seed: int | None, *, rooms: int, distractors: int, task_type: str | None,
                   split: str) -> World:
    """A home, its objects and a task of ``split``'s pairs and templates; the same arguments give the same world."""
    rng = random.Random(seed)
    task_type = task_type or rng.choice(TASK_TYPES)
    allowed = [c for c in task_combos(task_type) if combo_split(*c) == split]
    for _ in range(200):
        room_list, templates = _choose_home(rng, task_type, rooms, split)
        recep_room = _build_receptacles(rng, room_list, templates)
        type_counts: dict[str, int] = {}
        for name in recep_room:
            type_counts[rtype(name)] = type_counts.get(rtype(name), 0) + 1
        has_lamp = any(r in LAMP_HOST for r in room_list)
        candidates = [c for c in allowed if _feasible(c, type_counts, has_lamp)]
        if candidates:
            break
    else:
        raise RuntimeError(f"household: no {split} {task_type} task fits {rooms} rooms after 200 homes; "
                           f"use more rooms or another task_type")
    obj_type, target_type = rng.choice(candidates)
    receptacles = tuple(recep_room)
    lamps: dict[str, str] = {}
    for room in room_list:
        if room in LAMP_HOST:
            host = next(r for r in receptacles if recep_room[r] == room and rtype(r) == LAMP_HOST[room])
            lamps[f"desklamp {len(lamps) + 1}"] = host
    pick_two = task_type == "pick_two_obj_and_place"
    n_task_objects = (2 if pick_two else 1) + (rng.random() < 0.3)
    starts = [r for r in receptacles if rtype(r) in OBJECTS[obj_type][0] and rtype(r) != target_type]
    placements = [(obj_type, rng.choice(starts)) for _ in range(n_task_objects)]
    pool = [t for t in OBJECTS if t != obj_type and any(r in type_counts for r in OBJECTS[t][0])]
    for _ in range(distractors):
        kind = rng.choice(pool)
        placements.append((kind, rng.choice([r for r in receptacles if rtype(r) in OBJECTS[kind][0]])))
    counters: dict[str, int] = {}
    initial: dict[str, str] = {}
    for kind, recep in placements:
        counters[kind] = counters.get(kind, 0) + 1
        initial[f"{kind} {counters[kind]}"] = recep
    task = Task(task_type=task_type, obj_type=obj_type, target_type=target_type, count=2 if pick_two else 1,
                process=PROCESS_OF_TASK.get(task_type))
    start_room = rng.choice(room_list)
    digest = repr((room_list, templates, receptacles, sorted(lamps.items()), sorted(initial.items()), task,
                   start_room))
    return World(world_id=hashlib.sha1(digest.encode()).hexdigest()[:8], rooms=tuple(room_list),
                 templates=tuple(templates), receptacles=receptacles, recep_room=recep_room, lamps=lamps,
                 initial=initial, start_room=start_room, task=task)


# ------------------------------------------------------------------------------------------- progress and expert
def is_open(state: State, recep: str) -> bool:
    """Whether ``recep``'s contents can be seen and reached (always, unless it is a closed openable one)."""
    return rtype(recep) not in OPENABLE or recep in state.opened


def counts(task: Task, state: State, obj: str) -> bool:
    """Whether ``obj`` is of the task's type and in the state the task asks for (clean, hot, cold)."""
    return rtype(obj) == task.obj_type and (task.process is None or obj in state.states[task.process])


def lit_here(world: World, state: State) -> bool:
    """Whether a lamp that is on stands on the receptacle the agent is at."""
    return any(host == state.loc and lamp in state.lamps_on for lamp, host in world.lamps.items())


def targets(world: World) -> list[str]:
    """The receptacles of the task's target type (any of them takes the win)."""
    return [r for r in world.receptacles if rtype(r) == world.task.target_type]


def placed_in(world: World, state: State, recep: str) -> int:
    """How many counting objects are in ``recep``."""
    return sum(1 for obj, where in state.where.items() if where == recep and counts(world.task, state, obj))


def placed(world: World, state: State) -> int:
    """The most counting objects in any one target-type receptacle (ALFWorld's pick_two wants both in one)."""
    return max((placed_in(world, state, r) for r in targets(world)), default=0)


def is_won(world: World, state: State) -> bool:
    task = world.task
    if task.task_type == "look_at_obj_in_light":
        return state.held is not None and rtype(state.held) == task.obj_type and lit_here(world, state)
    return placed(world, state) >= task.count


def subgoal_names(task: Task) -> list[str]:
    """Short names of the task's subgoals, in order."""
    obj, target = task.obj_type, task.target_type
    if task.task_type == "look_at_obj_in_light":
        return [f"take {obj}", "use desklamp"]
    if task.task_type == "pick_two_obj_and_place":
        return [f"take first {obj}", f"put first {obj} in {target}",
                f"take second {obj}", f"put second {obj} in {target}"]
    middle = [f"{task.process} {obj}"] if task.process else []
    return [f"take {obj}", *middle, f"put {obj} in {target}"]


def progress(world: World, state: State) -> int:
    """Subgoals the current state shows done (the env keeps the running maximum, so it never decreases)."""
    task = world.task
    total = len(subgoal_names(task))
    if is_won(world, state):
        return total
    holding = state.held is not None and rtype(state.held) == task.obj_type
    if task.task_type == "pick_two_obj_and_place":
        return 2 * min(placed(world, state), 1) + holding
    if task.process and holding and state.held in state.states[task.process]:
        return 2
    return int(holding)


def _pick(options: list[str], world: World, state: State) -> str:
    """The option in the agent's current room first, then by name: the expert's deterministic tie-break."""
    return min(options, key=lambda r: (world.recep_room[r] != state.room, r))


def _target(world: World, state: State) -> str:
    """The target-type receptacle the expert fills: the one holding the most counting objects, then, carrying one,
    the nearest (here, open, this room); ties by name. Empty-handed the choice ignores where the agent is, so the
    object it fetches never makes it change its mind."""
    def key(recep: str) -> tuple:
        near = (recep != state.loc, not is_open(state, recep), world.recep_room[recep] != state.room)
        return (-placed_in(world, state, recep), near if state.held is not None else (), recep)
    return min(targets(world), key=key)


def _reach(state: State, recep: str) -> str | None:
    """Action that brings ``recep`` within reach (go there, then open it); None once it is reachable."""
    if state.loc != recep:
        return f"go to {recep}"
    if not is_open(state, recep):
        return f"open {recep}"
    return None


def expert_action(world: World, state: State) -> str | None:
    """Next action of an omniscient planner from the current state (any history); None once won or stuck."""
    task = world.task
    if is_won(world, state):
        return None
    held = state.held
    if held is not None and rtype(held) == task.obj_type:
        if task.task_type == "look_at_obj_in_light":
            lamp = min(world.lamps, key=lambda k: (k not in state.lamps_on, world.recep_room[world.lamps[k]]
                                                   != state.room, k))
            return _reach(state, world.lamps[lamp]) or f"use {lamp}"
        if task.process and held not in state.states[task.process]:
            appliances = [r for r in world.receptacles if rtype(r) == APPLIANCE_OF[task.process]]
            appliance = _pick(appliances, world, state)
            if state.loc != appliance:
                return f"go to {appliance}"
            return f"{task.process} {held} with {appliance}"
        target = _target(world, state)
        return _reach(state, target) or f"put {held} in {target}"
    if held is not None:  # a wrong object: put it down right here (or at the nearest open-topped receptacle)
        if state.loc is None:
            spots = [r for r in world.receptacles if rtype(r) not in OPENABLE]
            return f"go to {_pick(spots, world, state)}"
        return _reach(state, state.loc) or f"put {held} in {state.loc}"
    target = _target(world, state) if task.task_type != "look_at_obj_in_light" else None
    wanted = [o for o, r in state.where.items()
              if rtype(o) == task.obj_type and not (r == target and counts(task, state, o))]
    if not wanted:
        return None

    def cost(obj: str) -> tuple:
        recep = state.where[obj]
        steps = (recep != state.loc) + (not is_open(state, recep)) + (task.process is not None
                                                                     and not counts(task, state, obj))
        return steps, world.recep_room[recep] != state.room, obj

    obj = min(wanted, key=cost)
    recep = state.where[obj]
    return _reach(state, recep) or f"take {obj} from {recep}"
