"""Heads-up limit Texas hold'em as a text env: rlcard's real ``limit-holdem`` game against a fixed opponent.

The agent is rlcard player 0; the opponent (player 1) is one of ``OPPONENTS``:

- ``rule``: rlcard's own ``LimitholdemRuleAgentV1`` (raises pairs and strong aces preflop, folds most other hands,
  even when checking would be free). Deterministic given the cards.
- ``random``: a uniformly random legal action drawn from a numpy Generator seeded by the episode seed. (rlcard's
  ``RandomAgent`` draws from numpy's global RNG, which no env can seed safely, so it is re-implemented here.)
- ``caller``: always ``check`` when free, else ``call``: never folds, never raises.

Blinds are 1/2 chips, bets 2 chips preflop and on the flop, 4 on the turn and river, at most 4 raises a round.
rlcard draws who posts the small blind (and so acts first preflop) for every hand from the seeded game RNG, so the
agent's position varies with the seed. A *walk* (the opponent folds as small blind before the agent has acted) is
re-dealt and not counted: the agent has no decision in it, and every episode starts at an agent decision.

An episode is ``hands`` counted hands (default 1). Reward: on the step that ends a hand, the agent's payoff for it
as rlcard reports it, in big blinds (chips won or lost / 2: folding the small blind is -0.5); 0 otherwise.
``won`` becomes True when the last hand is over with a total payoff > 0 (a truncated episode is not won).

Observation (short)::

    hand 1/1, flop, you small blind
    cards: Ah Kd | board: Qs 7c 2d
    pot 8: you 4, opp 4
    opp: call, check
    legal: raise fold check

``opp:`` lists the opponent's actions since the agent's last one. With ``hands > 1`` the first line also carries
the running total (``total +1.5bb``) and the previous hand's result. Actions are rlcard's names ``call, raise,
fold, check``; only the legal ones (``admissible_actions``) are valid, anything else is an invalid action (no
effect, reward ``-invalid_penalty``, the step still counts towards ``max_steps``).

Anchor: the agent's information state, ``[h<k>|]<pos>|<hole>|<board>|<betting>`` (hole cards and flop sorted,
betting one letter per action: c call, r raise, f fold, k check, one ``/``-separated entry per round reached),
e.g. ``sb|AhKd|Qs7c2d|rc/k``. Equal information states share an anchor whatever the hidden opponent cards are.
Expert: none (``expert_action()`` is None): a hand-strength heuristic is no solver of the game.
Scenario key (``scenario_key``): the deal, hidden cards included: opponent, hands, the agent's position, both
players' hole cards and the five board cards to come (flop sorted). The random opponent's coin flips are noise, not
content. With ``hands > 1`` the later deals come from rlcard's RNG, so its state joins the key (each seed its own
match).
Pure module: no Prefect, MLflow, DVC or file I/O.
"""
from __future__ import annotations

import hashlib
from typing import Any, Callable

import numpy as np

from envs.base import check_reset_options, register_env

ACTIONS: tuple[str, ...] = ("call", "raise", "fold", "check")  # rlcard's limit-holdem action names
OPPONENTS: tuple[str, ...] = ("rule", "random", "caller")
RESET_OPTIONS: tuple[str, ...] = ("opponent", "hands")
ROUND_NAMES: tuple[str, ...] = ("preflop", "flop", "turn", "river")
STEPS_PER_HAND = 16  # default max_steps per hand: at most 12 legal agent actions a hand, plus slack
_RANKS = "23456789TJQKA"
_LETTER = {"call": "c", "raise": "r", "fold": "f", "check": "k"}
_MAX_REDEALS = 1000
OpponentPolicy = Callable[[dict, np.random.Generator], str]


def card_text(card: str) -> str:
    """rlcard card ``'SA'`` (suit, rank) as ``'As'`` (rank, lowercase suit)."""
    return card[1] + card[0].lower()


def sort_cards(cards: list[str]) -> list[str]:
    """Cards (``'As'`` form) sorted high rank first, then by suit: one canonical order for a set of cards."""
    return sorted(cards, key=lambda c: (-_RANKS.index(c[0]), c[1]))


def rule_opponent(state: dict, rng: np.random.Generator) -> str:
    """rlcard's ``LimitholdemRuleAgentV1``; an illegal pick (never seen heads-up) falls back to check/call/fold."""
    from rlcard.models.limitholdem_rule_models import LimitholdemRuleAgentV1  # rlcard loads in seconds: on use

    action = LimitholdemRuleAgentV1.step(state)
    legal = state["raw_legal_actions"]
    if action in legal:
        return action
    return next(a for a in ("check", "call", "fold") if a in legal)


def random_opponent(state: dict, rng: np.random.Generator) -> str:
    """A uniformly random legal action from the episode's seeded Generator."""
    legal = state["raw_legal_actions"]
    return legal[int(rng.integers(len(legal)))]


def caller_opponent(state: dict, rng: np.random.Generator) -> str:
    """Check when free, else call."""
    return "check" if "check" in state["raw_legal_actions"] else "call"


OPPONENT_POLICIES: dict[str, OpponentPolicy] = {
    "rule": rule_opponent, "random": random_opponent, "caller": caller_opponent}


@register_env("holdem")
class HoldemText:
    """Heads-up limit hold'em against a fixed opponent, behind the text-env contract (see envs/base.py).

    ``max_steps`` defaults to ``16 * hands``; it counts every agent step, valid or not, and truncates.
    """

    def __init__(self, opponent: str = "rule", hands: int = 1, max_steps: int | None = None,
                 verbosity: str = "short", invalid_penalty: float = 0.0) -> None:
        self.opponent = _check_opponent(opponent)
        self.hands = _check_hands(hands)
        if max_steps is not None and max_steps < 1:
            raise ValueError(f"holdem: max_steps must be >= 1 (or None for 16 per hand), got {max_steps}")
        if verbosity not in ("short", "full"):
            raise ValueError(f"holdem: verbosity must be 'short' or 'full', got {verbosity!r}")
        self._max_steps_arg = max_steps
        self.max_steps = int(max_steps) if max_steps is not None else STEPS_PER_HAND * self.hands
        self.verbosity = verbosity
        self.invalid_penalty = float(invalid_penalty)
        import rlcard  # on use: `import envs` (every config read) registers this env without loading rlcard

        self._rl: Any = rlcard.make("limit-holdem", config={"seed": 0})
        self._policy: OpponentPolicy = OPPONENT_POLICIES[self.opponent]
        self._episode_opponent = self.opponent
        self._rng = np.random.default_rng(0)
        self._episode_hands = self.hands
        self._hand = 0  # 1-based number of the hand being played
        self._total = 0.0  # bb, over finished hands
        self._history: list[list[str]] = []  # per betting round: action letters of both players
        self._opp_recent: list[str] = []  # opponent actions since the agent's last action
        self._agent_sb = False
        self._last_result = ""
        self._steps = 0
        self._started = False
        self._done = True
        self._won = False

    # ----------------------------------------------------------------------------------------- contract
    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        options = check_reset_options("holdem", options, RESET_OPTIONS)
        opponent = _check_opponent(options.get("opponent", self.opponent))
        self._episode_hands = _check_hands(options.get("hands", self.hands))
        if self._max_steps_arg is None:
            self.max_steps = STEPS_PER_HAND * self._episode_hands
        if seed is None:
            seed = int(np.random.SeedSequence().generate_state(1)[0])
        if not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"holdem: seed must be a non-negative int (rlcard's requirement), got {seed!r}")
        self._rl.seed(int(seed))  # rlcard hashes the seed (sha512): the same deals in every process
        self._rng = np.random.default_rng(np.random.SeedSequence([int(seed), 1]))
        self._policy, self._episode_opponent = OPPONENT_POLICIES[opponent], opponent
        self._hand, self._total, self._last_result = 0, 0.0, ""
        self._steps, self._started, self._done, self._won = 0, True, False, False
        self._deal_next_hand()
        return self._observation(), self._info(action_valid=True)

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        if not self._started:
            raise RuntimeError("holdem: step() before reset(); call reset(seed=...) first")
        if self._done:
            raise RuntimeError("holdem: the episode is over; call reset() before stepping again")
        word = action.strip().lower() if isinstance(action, str) else ""
        self._steps += 1
        valid = word in self._legal_actions()
        reward, terminated = 0.0 - self.invalid_penalty, False
        if valid:
            reward = 0.0
            self._opp_recent = []
            self._act(word)
            self._play_opponent()
            if self._rl.is_over():
                reward = self._settle_hand()
                terminated = self._hand >= self._episode_hands
                if terminated:
                    self._won = self._total > 0
                else:
                    self._deal_next_hand()
        truncated = not terminated and self._steps >= self.max_steps
        self._done = terminated or truncated
        return self._observation(), reward, terminated, truncated, self._info(action_valid=valid)

    def task_description(self) -> str:
        hands = "one hand" if self._episode_hands == 1 else f"{self._episode_hands} hands"
        return (f"Heads-up limit Texas hold'em, {hands} against a fixed opponent: win chips. "
                f"Actions: {', '.join(ACTIONS)} (only the legal ones).")

    def expert_action(self) -> str | None:
        """None: hold'em has no exact solver here (a hand-strength heuristic is not an expert)."""
        return None

    def scenario_key(self) -> str:
        """The deal (module docstring), read right after ``reset``: ``rule|1|sb|AhKd|7s2c|Qs7c2d|9h|Td``."""
        if not self._started:
            raise RuntimeError("holdem: scenario_key() before reset(); call reset(seed=...) first")
        game = self._rl.game
        hole, board = self._cards()
        opp = sort_cards([card_text(c.get_index()) for c in game.players[1].hand])
        board += [card_text(c.get_index()) for c in reversed(game.dealer.deck)][:5 - len(board)]  # deck pops its end
        board = sort_cards(board[:3]) + board[3:]
        pos = "sb" if self._agent_sb else "bb"
        parts = [self._episode_opponent, str(self._episode_hands), pos, "".join(hole), "".join(opp),
                 "".join(board[:3]), *board[3:]]
        if self._episode_hands > 1:
            state = game.np_random.get_state()
            parts.append(f"rng {hashlib.sha1(state[1].tobytes()).hexdigest()[:16]}:{state[2]}")
        return "|".join(parts)

    # ----------------------------------------------------------------------------------------- game flow
    def _deal_next_hand(self) -> None:
        """Start the next counted hand and play the opponent up to the agent's first decision; re-deal walks."""
        for _ in range(_MAX_REDEALS):
            self._rl.reset()
            self._history = [[] for _ in ROUND_NAMES]
            self._opp_recent = []
            self._agent_sb = self._rl.game.players[0].in_chips == self._rl.game.small_blind
            self._play_opponent()
            if not self._rl.is_over():
                self._hand += 1
                return
        raise RuntimeError(f"holdem: {_MAX_REDEALS} walks in a row: the opponent folds every hand")

    def _act(self, action: str) -> None:
        """Apply one legal action of the current player, recording it in the betting history."""
        self._history[self._rl.game.round_counter].append(_LETTER[action])
        self._rl.step(action, raw_action=True)

    def _play_opponent(self) -> None:
        while not self._rl.is_over() and self._rl.get_player_id() == 1:
            action = self._policy(self._rl.get_state(1), self._rng)
            self._opp_recent.append(action)
            self._act(action)

    def _settle_hand(self) -> float:
        """Payoff of the finished hand for the agent (bb); updates the total and the result line."""
        payoff = float(self._rl.get_payoffs()[0])
        self._total += payoff
        game = self._rl.game
        if game.players[1].status == "folded":
            how = "opp folded"
        elif game.players[0].status == "folded":
            how = "you folded"
        else:
            opp = " ".join(sort_cards([card_text(c.get_index()) for c in game.players[1].hand]))
            how = f"showdown, opp had {opp}"
        self._last_result = f"hand {self._hand}: {how}, you {payoff:+g}bb"
        return payoff

    # ----------------------------------------------------------------------------------------- views
    def _legal_actions(self) -> list[str]:
        if self._done or self._rl.is_over():
            return []
        return list(self._rl.game.get_legal_actions())

    def _cards(self) -> tuple[list[str], list[str]]:
        """(hole cards sorted, board with the flop sorted), agent's view."""
        game = self._rl.game
        hole = sort_cards([card_text(c.get_index()) for c in game.players[0].hand])
        board = [card_text(c.get_index()) for c in game.public_cards]
        return hole, sort_cards(board[:3]) + board[3:]

    def _observation(self) -> str:
        game = self._rl.game
        hole, board = self._cards()
        if self._rl.is_over():
            lines = [self._last_result or f"hand {self._hand} over"]
            if self._episode_hands > 1:
                lines.append(f"match over: total {self._total:+g}bb")
            lines.append(f"cards: {' '.join(hole)} | board: {' '.join(board) or '-'}")
            return "\n".join(lines)
        mine, theirs = game.players[0].in_chips, game.players[1].in_chips
        head = f"hand {self._hand}/{self._episode_hands}, {ROUND_NAMES[game.round_counter]}, "
        head += "you small blind" if self._agent_sb else "you big blind"
        if self._episode_hands > 1:
            head += f", total {self._total:+g}bb"
        lines = [head]
        if self._episode_hands > 1 and self._last_result:
            lines.append(f"last {self._last_result}")
        lines += [f"cards: {' '.join(hole)} | board: {' '.join(board) or '-'}",
                  f"pot {mine + theirs}: you {mine}, opp {theirs}",
                  f"opp: {', '.join(self._opp_recent) or '-'}"]
        if self.verbosity == "full":
            lines.append(f"betting: {self._betting() or '-'}")
        lines.append(f"legal: {' '.join(game.get_legal_actions())}")
        return "\n".join(lines)

    def _betting(self) -> str:
        current = min(self._rl.game.round_counter, len(ROUND_NAMES) - 1)  # 4 once the river is over
        return "/".join("".join(r) for r in self._history[:current + 1])

    def _anchor(self) -> str:
        hole, board = self._cards()
        pos = "sb" if self._agent_sb else "bb"
        anchor = f"{pos}|{''.join(hole)}|{''.join(board)}|{self._betting()}"
        return anchor if self._episode_hands == 1 else f"h{self._hand}|{anchor}"

    def _info(self, *, action_valid: bool) -> dict:
        return {
            "anchor": self._anchor(),
            "action_valid": action_valid,
            "won": self._won,
            "admissible_actions": self._legal_actions(),
            "hand": self._hand,
            "total_bb": self._total,
            "steps": self._steps,
        }


def _check_opponent(opponent: Any) -> str:
    if opponent not in OPPONENTS:
        raise ValueError(f"holdem: unknown opponent {opponent!r}; valid opponents: {list(OPPONENTS)}")
    return str(opponent)


def _check_hands(hands: Any) -> int:
    if isinstance(hands, bool) or not isinstance(hands, (int, np.integer)) or hands < 1:
        raise ValueError(f"holdem: hands must be an int >= 1, got {hands!r}")
    return int(hands)
