"""Multi-turn layouts: step rows and concatenated trajectories from StepRecords, next-token collation, masking."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agents.prompts import build_prompt, response_text
from datapool.records import StepRecord
from models.build import train_tokenizer
from models.layouts import TURN_TEMPLATE, RowSpec, collate_rows, concatenated, step_rows
from models.losses import LossConfig, entropy_from_logits, policy_objective
from models.batching import TrainRow, collate

PAD, EOS = 0, 3


class CharTokenizer:
    """One id per character (ord), so encoded text is easy to write down by hand."""

    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=False, clean_up_tokenization_spaces=False):
        return "".join(chr(i) for i in ids)


class TableTokenizer:
    """Decodes ids through a fixed table of multi-character pieces (encode is never needed in the prefix case)."""

    def __init__(self, pieces: list[str]):
        self.pieces = pieces

    def encode(self, text, add_special_tokens=True):
        raise AssertionError("prefix-consistent steps must not be tokenized")

    def decode(self, ids, skip_special_tokens=False, clean_up_tokenization_spaces=False):
        return "".join(self.pieces[i] for i in ids)


def step(index, prompt_ids, response_ids, observation="", *, logprobs=None, trajectory="t0", group="g0"):
    return StepRecord(
        trajectory_id=trajectory, group_id=group, step_index=index, prompt_ids=list(prompt_ids),
        response_ids=list(response_ids),
        logprobs=[-0.1 * (i + 1) for i in range(len(response_ids))] if logprobs is None else logprobs,
        prompt_text="", observation=observation, action="", response_text="", reward=0.0, anchor="",
        policy_version="v0")


def test_step_rows_one_row_per_step():
    rows = step_rows([step(0, [5, 6], [7, 8, EOS]), step(1, [5, 9], [4], logprobs=[])])
    assert [r.input_ids for r in rows] == [[5, 6, 7, 8, EOS], [5, 9, 4]]
    assert [r.response_mask for r in rows] == [[0, 0, 1, 1, 1], [0, 0, 1]]
    assert [r.observation_mask for r in rows] == [[0] * 5, [0] * 3]
    assert rows[0].old_logprobs == pytest.approx([0, 0, -0.1, -0.2, -0.3])
    assert [r.turn_index for r in rows] == [[-1, -1, 0, 0, 0], [-1, -1, 0]]
    assert [r.has_old_logprobs for r in rows] == [True, False]
    assert [r.step_indices for r in rows] == [(0,), (1,)]
    with pytest.raises(ValueError, match="corrupt"):
        step_rows([step(0, [5], [7, 8], logprobs=[-1.0])])


def test_concatenated_prefix_consistent_uses_the_prompt_ids_and_finds_the_observation():
    """Step 1's prompt extends step 0's prompt + response; the ids in between are taken as they are, and the
    observation ("lit room") is located by decoding. Piece 6 (" room\\nAct") straddles the end of the observation:
    it overlaps it, so it counts as observation; piece 3 ("\\nState:\\n") and piece 8 ("ion:") are template."""
    pieces = ["<eos>", "Task: go", "dark room", "\nState:\n", "lit", " r", " room\nAct", "\nAction:", "ion:",
              " north", " east"]
    p0 = [1, 3, 2, 7]
    r0 = [9, 0]
    between = [3, 4, 6, 8]
    r1 = [10, 0]
    steps = [step(1, p0 + r0 + between, r1, "lit room"), step(0, p0, r0, "dark room")]  # any order
    row = concatenated(steps, TableTokenizer(pieces))
    assert row.input_ids == p0 + r0 + between + r1
    assert row.response_mask == [0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 1, 1]
    assert row.observation_mask == [0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0]
    assert row.turn_index == [-1, -1, -1, -1, 0, 0, -1, -1, -1, -1, 1, 1]
    assert row.old_logprobs == pytest.approx([0, 0, 0, 0, -0.1, -0.2, 0, 0, 0, 0, -0.1, -0.2])
    assert row.step_indices == (0, 1) and row.trajectory_id == "t0" and row.has_old_logprobs

    # an observation that does not appear in the decoded ids marks nothing (never template tokens by accident)
    steps[0] = step(1, p0 + r0 + between, r1, "a different text")
    assert concatenated(steps, TableTokenizer(pieces)).observation_mask == [0] * 12


def test_concatenated_falls_back_to_the_template_and_keeps_response_ids_exactly():
    """Step 1's prompt was re-rendered (no eos inside, history as text): not a prefix extension. The text between
    turns is then TURN_TEMPLATE around step 1's observation, encoded piece by piece; the response ids (1000, 1001,
    which decode to nothing sensible) are copied, never re-tokenized."""
    tok = CharTokenizer()
    p0, r0 = tok.encode("Task: go\nState:\nab\nAction:"), [1000, EOS]
    p1, r1 = tok.encode("Task: go\nState:\nab\nAction: north\nState:\ncd\nAction:"), [1001, 1002, EOS]
    row = concatenated([step(0, p0, r0, "ab"), step(1, p1, r1, "cd")], tok)
    before, after = tok.encode("\nState:\n"), tok.encode("\nAction:")
    assert row.input_ids == p0 + r0 + before + tok.encode("cd") + after + r1
    assert row.response_mask == [0] * len(p0) + [1, 1] + [0] * (len(before) + 2 + len(after)) + [1, 1, 1]
    assert row.observation_mask == [0] * (len(p0) + 2 + len(before)) + [1, 1] + [0] * (len(after) + 3)
    assert [i for i, m in zip(row.input_ids, row.response_mask) if m] == r0 + r1

    custom = concatenated([step(0, p0, r0), step(1, p1, r1, "cd")], tok, turn_template="<{observation}>")
    assert custom.input_ids == p0 + r0 + tok.encode("<cd>") + r1
    with pytest.raises(ValueError, match="exactly once"):
        concatenated([step(0, p0, r0)], tok, turn_template="no field")
    with pytest.raises(ValueError, match="trajectory_id"):
        concatenated([step(0, p0, r0), step(1, p1, r1, trajectory="t1")], tok)
    with pytest.raises(ValueError, match="at least one"):
        concatenated([], tok)


def test_turn_template_matches_the_agent_prompts_with_a_real_tokenizer(env_like_texts):
    """Steps as agents.rollout records them (full history, prompts re-encoded, responses " action" + eos): the
    concatenated row decodes to the last prompt + its response, apart from the eos that ends each response."""
    tok = train_tokenizer(env_like_texts, vocab_size=320)
    eos = tok.eos_token_id
    task, observations, actions = "find the key", ["You are in the kitchen.", "Exits: north.", "Café, déjà vu."], \
        ["go north", "take key", "look"]
    steps = []
    for i, (obs, action) in enumerate(zip(observations, actions)):
        prompt = build_prompt(task, obs, list(zip(observations[:i], actions[:i])))
        response = tok.encode(response_text(action), add_special_tokens=False) + [eos]
        steps.append(step(i, tok.encode(prompt, add_special_tokens=False), response, obs))
    row = concatenated(steps, tok)
    expected = build_prompt(task, observations[-1], list(zip(observations[:-1], actions[:-1]))) + " " + actions[-1]
    assert tok.decode([i for i in row.input_ids if i != eos]) == expected
    assert [i for i, m in zip(row.input_ids, row.response_mask) if m] == [i for s in steps for i in s.response_ids]
    shown = [tok.decode([i for i, m in zip(row.input_ids, row.observation_mask) if m])]
    assert shown == ["".join(observations[1:])]  # not the first observation: it is in the initial prompt
    assert TURN_TEMPLATE.replace("{observation}", observations[1]) in expected


def test_collate_rows_aligns_masks_with_target_ids():
    tok = CharTokenizer()
    concat = concatenated([step(0, [65, 66], [200, EOS]), step(1, [1, 2, 3], [201, EOS], "o")], tok,
                          turn_template="|{observation}|")
    concat = concat._replace(step_advantages=(2.0, -1.0), success=True)
    single = step_rows([step(0, [70], [210], group="g1", trajectory="t9")])[0]._replace(advantage=0.5)
    batch = collate_rows([concat, single], pad_id=PAD)
    # row 0: A B 200 eos | o | 201 eos  (| and o encoded by ord)
    assert batch["input_ids"].tolist() == [[65, 66, 200, EOS, 124, 111, 124, 201, EOS], [70, 210] + [PAD] * 7]
    assert batch["attention_mask"].tolist() == [[1] * 9, [1, 1] + [0] * 7]
    assert batch["target_ids"][0].tolist() == [66, 200, EOS, 124, 111, 124, 201, EOS, PAD]
    assert batch["response_mask"].tolist() == [[0, 1, 1, 0, 0, 0, 1, 1, 0], [1] + [0] * 8]
    assert batch["observation_mask"][0].tolist() == [0, 0, 0, 0, 1, 0, 0, 0, 0]
    assert batch["target_ids"][batch["response_mask"].bool()].tolist() == [200, EOS, 201, EOS, 210]
    assert batch["target_ids"][batch["observation_mask"].bool()].tolist() == [ord("o")]
    assert batch["advantages"].tolist() == [[0, 2, 2, 0, 0, 0, -1, -1, 0], [0.5] + [0] * 8]
    assert batch["turn_index"][0].tolist() == [-1, 0, 0, -1, -1, -1, 1, 1, -1]
    torch.testing.assert_close(batch["old_logprobs"][0], torch.tensor([0, -0.1, -0.2, 0, 0, 0, -0.1, -0.2, 0]))
    assert batch["success"].tolist() == [True, False]
    assert batch["group_index"].tolist() == [0, 1]
    assert batch["has_old_logprobs"].tolist() == [True, True]


def test_collate_rows_matches_trainer_collate_on_step_rows():
    steps = [step(0, [5, 6], [7, 8, 9]), step(1, [4], [3], logprobs=[])]
    rows = [r._replace(advantage=a) for r, a in zip(step_rows(steps), (1.5, -1.0))]
    ours = collate_rows(rows, pad_id=PAD)
    theirs = collate([TrainRow(s.prompt_ids, s.response_ids, s.logprobs or None, a)
                      for s, a in zip(steps, (1.5, -1.0))], pad_id=PAD)
    for key, value in theirs.items():
        assert torch.equal(ours[key], value), key


def test_collate_rows_rejects_bad_rows():
    good = step_rows([step(0, [5], [6])])[0]
    with pytest.raises(ValueError, match="at least one"):
        collate_rows([], PAD)
    with pytest.raises(ValueError, match="empty prompt"):
        collate_rows(step_rows([step(0, [], [6])]), PAD)
    with pytest.raises(ValueError, match="per-token lists"):
        collate_rows([good._replace(observation_mask=[0])], PAD)
    with pytest.raises(ValueError, match="step_advantages"):
        collate_rows([good._replace(turn_index=[-1, 1], step_advantages=(1.0,))], PAD)
    with pytest.raises(ValueError, match="is empty"):
        collate_rows([RowSpec([], [], [], [], [], "t", "g", ())], PAD)


token_ids = st.lists(st.integers(10, 300), min_size=0, max_size=5)


@st.composite
def trajectories(draw):
    """1-4 steps; each next prompt either extends the previous prompt + response or is re-rendered."""
    steps, prompt = [], draw(st.lists(st.integers(10, 300), min_size=1, max_size=5))
    for k in range(draw(st.integers(1, 4))):
        response = draw(token_ids)
        steps.append(step(k, prompt, response, draw(st.text("abc xyz", max_size=4))))
        if draw(st.booleans()):
            prompt = prompt + response + draw(token_ids)
        else:
            prompt = draw(st.lists(st.integers(10, 300), min_size=1, max_size=8))
    return steps


@settings(max_examples=40, deadline=None)
@given(trajectory=trajectories(), seed=st.integers(0, 2**16))
def test_layouts_keep_responses_and_masked_tokens_get_no_gradient(trajectory, seed):
    """Both layouts keep every response id in order; through collate_rows + policy_objective (KL and entropy on),
    the logits of positions whose target is not a response token get exactly zero gradient."""
    tok = CharTokenizer()
    concat = concatenated(trajectory, tok)
    assert [i for i, m in zip(concat.input_ids, concat.response_mask) if m] == \
        [i for s in trajectory for i in s.response_ids]
    rows = [concat] + step_rows(trajectory)
    batch = collate_rows(rows, pad_id=PAD)
    mask = batch["response_mask"]                                           # [B, L]
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(*batch["input_ids"].shape, 301, generator=gen).requires_grad_()
    logp = torch.log_softmax(logits, -1).gather(-1, batch["target_ids"][..., None]).squeeze(-1)  # [B, L]
    noise = torch.randn(mask.shape, generator=gen)                         # [B, L]
    total, _ = policy_objective(logp, logp.detach() + 0.1 * noise, torch.randn(mask.shape, generator=gen), mask,
                                LossConfig(kl_beta=0.1, entropy_coef=0.01), ref_logp=logp.detach() - 0.1 * noise,
                                entropy=entropy_from_logits(logits, mask))
    total.backward()
    off = mask == 0
    assert torch.equal(logits.grad[off], torch.zeros(int(off.sum()), 301))
