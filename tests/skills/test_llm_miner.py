"""The LLM skill miner: answer parsing, prompt rendering, a real HTTP teacher (FastAPI + uvicorn on loopback), our
real gateway serving a tiny policy, the policy itself through EngineWriter, and revisions from failures.

The teacher stand-in is a small FastAPI app with the OpenAI chat-completions shape that answers a fixed skill and
keeps every request it got; the gateway and the engine run the tiny random policy, whose answers are gibberish,
which is the case the miner must report rather than raise or drop.
"""
from __future__ import annotations

import asyncio
import random
import socket
from dataclasses import dataclass, field

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse

from datapool.gateway.app import create_app
from datapool.gateway.config import GatewayConfig
from datapool.gateway.upstreams import LocalEngineUpstream
from datapool.store import DataPool
from tests.datapool.gateway.gateway_helpers import ThreadedServer
from models.build import TinyModelConfig, build_model, load_policy
from models.hf_engine import TransformersEngine
from skills.bank import Skill, skill_from_text, skill_to_text
from skills.llm_miner import (
    MINE_TEMPLATE,
    SkillAnswerError,
    TrajectoryText,
    load_template,
    mine_llm_skills,
    normalize_skill_name,
    parse_skill_answer,
    render_trajectories,
    revise_skill,
)
from skills.llm_writers import ChatEndpointWriter, EngineWriter, SkillWriterError

KEY_ENV = "ARLFLOW_TEST_MINER_KEY"
KEY = "sk-miner-test"
TEACHER_ANSWER = ("NAME: Unlock Door With Key\n"
                  "WHEN_TO_USE: When a locked door blocks the way and a key is somewhere in reach.\n"
                  "PROCEDURE:\n1. Look around for the key.\n2. Take the key.\n3. Unlock the door with the key.\n")
MINE_INSTRUCTION = "Write ONE skill that captures the reusable procedure"  # a line of skills/prompts/mine_skill.md


def trajectory(tid: str, *, won: bool = True, steps: int = 3, ret: float = 1.0, task: str = "open the door") -> \
        TrajectoryText:
    return TrajectoryText(tid, task, [(f"{tid} room {i}: a {{brace}} and $dollar", f"step-{i}") for i in range(steps)],
                          won, ret)


@dataclass
class ScriptedWriter:
    """A SkillWriter that answers from a list (the last answer repeats) and keeps the prompts it was given."""

    answers: list[str]
    prompts: list[str] = field(default_factory=list)

    def complete(self, prompt: str) -> str:
        self.prompts.append(prompt)
        return self.answers[min(len(self.prompts), len(self.answers)) - 1]


# ----------------------------------------------------------------------------------------------- servers

@dataclass
class Teacher:
    url: str
    requests: list[dict]
    answer: list[str]  # one element, replaceable by a test


def teacher_app(requests: list[dict], answer: list[str]) -> FastAPI:
    """A stand-in teacher model: OpenAI chat completions answering ``answer[0]``; failure modes under prefixes."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> dict:
        body = await request.json()
        requests.append({"body": body, "authorization": request.headers.get("authorization")})
        return {"id": "chatcmpl-teacher", "object": "chat.completion", "model": body.get("model"),
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": answer[0]}}]}

    @app.post("/broken/v1/chat/completions")
    async def broken() -> JSONResponse:
        return JSONResponse({"error": {"message": "teacher crashed: CUDA out of memory", "type": "server_error",
                                       "param": None, "code": 500}}, status_code=500)

    @app.post("/html/v1/chat/completions")
    async def html() -> HTMLResponse:
        return HTMLResponse("<html><body>Please log in</body></html>")

    @app.post("/nochoices/v1/chat/completions")
    async def nochoices() -> dict:
        return {"object": "chat.completion", "choices": []}

    @app.post("/slow/v1/chat/completions")
    async def slow() -> dict:
        await asyncio.sleep(1.0)
        return {"choices": [{"message": {"content": answer[0]}}]}

    return app


@pytest.fixture(scope="module")
def teacher_server():
    requests: list[dict] = []
    answer = [TEACHER_ANSWER]
    with ThreadedServer(teacher_app(requests, answer)) as server:
        yield Teacher(server.url, requests, answer)


@pytest.fixture
def teacher(teacher_server, monkeypatch):
    monkeypatch.setenv(KEY_ENV, KEY)
    teacher_server.requests.clear()
    teacher_server.answer[0] = TEACHER_ANSWER
    return teacher_server


@pytest.fixture(scope="module")
def long_context_engine(tiny_policy_dir):
    """(engine, tokenizer): the tiny policy's tokenizer and architecture with room for a miner prompt (2048
    positions; the session's tiny policy has 256, fewer than the template alone)."""
    _, tokenizer = load_policy(tiny_policy_dir)
    model = build_model(tokenizer, TinyModelConfig(arch="qwen2", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, max_position_embeddings=2048), seed=0)
    return TransformersEngine(model, tokenizer, policy_version="tiny-long-v0"), tokenizer


# ----------------------------------------------------------------------------------------------- parsing

def test_parse_round_trips_through_skill_md():
    skill = parse_skill_answer(TEACHER_ANSWER, round_index=3, provenance=["t-1", "t-2"])
    assert skill.name == "unlock-door-with-key"
    assert skill.when_to_use == "When a locked door blocks the way and a key is somewhere in reach."
    assert skill.procedure == "1. Look around for the key.\n2. Take the key.\n3. Unlock the door with the key."
    assert (skill.version, skill.parent, skill.provenance) == (1, None, ("t-1", "t-2"))
    assert skill.stats == {"source": "llm", "round": 3}
    assert skill_from_text(skill_to_text(skill)) == skill
    # the skill's own fields, written back in the answer format, parse to the same skill
    again = f"NAME: {skill.name}\nWHEN_TO_USE: {skill.when_to_use}\nPROCEDURE:\n{skill.procedure}"
    assert parse_skill_answer(again, round_index=3, provenance=["t-1", "t-2"]) == skill


def test_parse_tolerates_chatter_fences_markdown_and_normalizes_the_name():
    answer = ("Sure! Here is the skill you asked for.\n```\n**Name:** Find_The KEY!! (v2)\n"
              "**When to use:** When a door\n  is locked.\nPROCEDURE: 1. look\n2. take key\n```\n")
    skill = parse_skill_answer(answer, round_index=0, provenance=["a"], parent="old-skill", version=4)
    assert skill.name == "find_the-key-v2"
    assert skill.when_to_use == "When a door is locked."
    assert skill.procedure == "1. look\n2. take key"
    assert (skill.parent, skill.version) == ("old-skill", 4)
    assert normalize_skill_name("  Café -- Door  ") == "caf-door"
    assert len(normalize_skill_name("x" * 200)) == 64


@pytest.mark.parametrize("answer, reason", [
    ("the the the room room key key key", "no NAME:, WHEN_TO_USE:, PROCEDURE: line"),
    ("NAME: open-door\nPROCEDURE:\n1. open it", "no WHEN_TO_USE: line"),
    ("NAME: open-door\nWHEN_TO_USE: doors.\nPROCEDURE:\n\n   \n", "PROCEDURE is empty"),
    ("NAME:\nWHEN_TO_USE: doors.\nPROCEDURE:\n1. open", "NAME is empty"),
    ("NAME: !!! ???\nWHEN_TO_USE: doors.\nPROCEDURE:\n1. open", "gives no valid skill name"),
    ("NAME: rejected\nWHEN_TO_USE: doors.\nPROCEDURE:\n1. open", "reserved"),
    ("NAME: <lowercase-hyphenated name>\nWHEN_TO_USE: <one sentence>\nPROCEDURE:\n<numbered steps>",
     "repeats the template's placeholder"),
])
def test_parse_rejects_with_the_reason(answer, reason):
    with pytest.raises(SkillAnswerError, match=reason):
        parse_skill_answer(answer, round_index=0, provenance=[])


# ----------------------------------------------------------------------------------------------- rendering

def test_render_keeps_braces_and_dollars_and_shortens_long_episodes():
    long_one = trajectory("long", steps=20)
    text = render_trajectories([long_one, trajectory("short")], max_steps_each=4)
    assert "### Trajectory long (won, return 1)" in text and "Task: open the door" in text
    assert "long room 0: a {brace} and $dollar" in text and "Action: step-19" in text
    assert "[... 16 steps omitted ...]" in text and "Step 5\n" not in text.split("### Trajectory short")[0]
    # max_chars keeps whole trajectories while they fit; the first one is cut rather than dropped
    assert "### Trajectory short" not in render_trajectories([long_one, trajectory("short")], max_chars=900)
    cut = render_trajectories([trajectory("huge", steps=200)], max_chars=300)
    assert len(cut) <= 300 and cut.endswith("[... cut]")


def test_template_placeholders_are_checked(tmp_path):
    bad = tmp_path / "bad.md"
    bad.write_text("<!-- no trajectories here -->\nWrite a skill.\n")
    with pytest.raises(ValueError, match=r"lacks the placeholders \['\$trajectories'\]"):
        load_template(bad, ("trajectories",))
    assert "<!--" not in load_template(MINE_TEMPLATE, ("trajectories",)).template
    with pytest.raises(FileNotFoundError, match="prompt template .* missing"):
        mine_llm_skills(ScriptedWriter([TEACHER_ANSWER]), [trajectory("t")], round_index=0,
                        template_path=tmp_path / "nope.md")


# ----------------------------------------------------------------------------------------------- mining logic

def test_mine_groups_deterministically_and_renames_clashes():
    trajs = [trajectory(f"t{i}", steps=2 + i % 3, ret=1.0 if i < 6 else 0.5) for i in range(8)]
    first, second = ScriptedWriter([TEACHER_ANSWER]), ScriptedWriter([TEACHER_ANSWER])
    skills, failures = mine_llm_skills(first, trajs, round_index=1, max_skills=3, trajectories_per_prompt=3,
                                       existing_names=["unlock-door-with-key"])
    shuffled = trajs[:]
    random.Random(0).shuffle(shuffled)
    mine_llm_skills(second, shuffled, round_index=1, max_skills=3, trajectories_per_prompt=3)
    assert failures == [] and first.prompts == second.prompts and len(first.prompts) == 3
    assert [s.name for s in skills] == ["unlock-door-with-key-2", "unlock-door-with-key-3", "unlock-door-with-key-4"]
    # highest return first, then fewest steps, then id: t0 t3 (2 steps), t1 t4 (3), t2 t5 (4), then t6 t7 (0.5)
    assert [s.provenance for s in skills] == [("t0", "t3", "t1"), ("t4", "t2", "t5"), ("t6", "t7")]
    assert all(s.stats == {"source": "llm", "round": 1} for s in skills)


def test_mine_reports_unusable_answers_and_keeps_the_rest():
    writer = ScriptedWriter(["I am not sure what you mean.", TEACHER_ANSWER])
    skills, failures = mine_llm_skills(writer, [trajectory("a"), trajectory("b", steps=5)], round_index=2,
                                       max_skills=2, trajectories_per_prompt=1)
    assert [s.provenance for s in skills] == [("b",)]
    assert len(failures) == 1 and failures[0].startswith("prompt 0 (trajectories a): unusable answer: the answer has "
                                                         "no NAME:")
    assert "I am not sure what you mean." in failures[0]
    assert mine_llm_skills(writer, [], round_index=2) == ([], ["no successful trajectories to mine from"])
    with pytest.raises(ValueError, match=r"\['lost'\] have won=False"):
        mine_llm_skills(writer, [trajectory("lost", won=False)], round_index=2)


def test_provenance_is_what_the_prompt_showed():
    writer = ScriptedWriter([TEACHER_ANSWER])
    trajs = [trajectory(f"t{i}", steps=6) for i in range(4)]
    skills, _ = mine_llm_skills(writer, trajs, round_index=0, trajectories_per_prompt=4, max_chars=1000)
    assert skills[0].provenance == ("t0", "t1")  # the others did not fit in 1000 characters (~460 each)
    assert "### Trajectory t1" in writer.prompts[0] and "### Trajectory t2" not in writer.prompts[0]


# ----------------------------------------------------------------------------------------------- HTTP teacher

def test_chat_endpoint_writer_mines_from_a_teacher_server(teacher):
    writer = ChatEndpointWriter(f"{teacher.url}/v1/", "teacher-model", api_key_env=KEY_ENV, max_tokens=300)
    assert KEY not in repr(vars(writer))  # the key is read from the environment at each call, never stored
    skills, failures = mine_llm_skills(writer, [trajectory("ep-7"), trajectory("ep-9", steps=2)], round_index=5,
                                       existing_names=["seq-left-right"])
    assert failures == []
    assert [(s.name, s.provenance, s.stats) for s in skills] == [
        ("unlock-door-with-key", ("ep-9", "ep-7"), {"source": "llm", "round": 5})]
    (request,) = teacher.requests
    assert request["authorization"] == f"Bearer {KEY}"
    body = request["body"]
    assert (body["model"], body["max_tokens"], body["temperature"]) == ("teacher-model", 300, 0.0)
    (message,) = body["messages"]
    assert message["role"] == "user" and MINE_INSTRUCTION in message["content"]
    assert "### Trajectory ep-7 (won, return 1)" in message["content"]
    assert "ep-9 room 1: a {brace} and $dollar\nAction: step-1" in message["content"]
    assert "<!--" not in message["content"] and "$trajectories" not in message["content"]


def test_chat_endpoint_writer_gives_clear_errors(teacher, monkeypatch):
    with pytest.raises(SkillWriterError, match=r"/broken/v1/chat/completions answered HTTP 500: teacher crashed: "
                                               r"CUDA out of memory: see the server's log"):
        ChatEndpointWriter(f"{teacher.url}/broken/v1", "m").complete("hi")
    with pytest.raises(SkillWriterError, match=r"/html/v1/chat/completions answered HTTP 200 with a body that is not "
                                               r"JSON .*Please log in.*OpenAI-compatible API"):
        mine_llm_skills(ChatEndpointWriter(f"{teacher.url}/html/v1", "m"), [trajectory("a")], round_index=0)
    with pytest.raises(SkillWriterError, match=r"JSON without choices\[0\]\.message\.content"):
        ChatEndpointWriter(f"{teacher.url}/nochoices/v1", "m").complete("hi")
    with pytest.raises(SkillWriterError, match=r"no answer from .*/slow/v1/chat/completions within 0.2 s"):
        ChatEndpointWriter(f"{teacher.url}/slow/v1", "m", timeout_s=0.2).complete("hi")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]
    with pytest.raises(SkillWriterError, match=rf"could not reach http://127.0.0.1:{closed}/v1/chat/completions"):
        ChatEndpointWriter(f"http://127.0.0.1:{closed}/v1", "m").complete("hi")
    monkeypatch.delenv(KEY_ENV)
    with pytest.raises(SkillWriterError, match=rf"environment variable {KEY_ENV} \(api_key_env\) is not set"):
        ChatEndpointWriter(f"{teacher.url}/v1", "m", api_key_env=KEY_ENV)
    with pytest.raises(ValueError, match="must be an http"):
        ChatEndpointWriter("localhost:8000/v1", "m")
    with pytest.raises(ValueError, match="api_key_env"):
        ChatEndpointWriter(f"{teacher.url}/v1", "m", headers={"Authorization": "Bearer x"})


def test_revise_skill_through_the_teacher(teacher):
    old = Skill("unlock-door-with-key", "When a door is locked.", "1. Unlock the door.", version=2,
                parent="seq-take-unlock", provenance=("ep-1",), stats={"source": "llm", "round": 1},
                macro=("take key", "unlock door"))
    teacher.answer[0] = ("NAME: better-door-skill\nWHEN_TO_USE: When a door is locked.\nPROCEDURE:\n"
                         "1. Take the key first.\n2. Unlock the door.")
    writer = ChatEndpointWriter(f"{teacher.url}/v1", "teacher-model", api_key_env=KEY_ENV)
    failing = [trajectory("bad-1", won=False, ret=0.0), trajectory("bad-2", won=False, ret=0.0)]
    revised, note = revise_skill(writer, old, failing, round_index=4)
    assert revised == Skill("unlock-door-with-key", "When a door is locked.",
                            "1. Take the key first.\n2. Unlock the door.", version=3, parent="unlock-door-with-key",
                            provenance=("bad-1", "bad-2"), stats={"source": "llm-revision", "round": 4})
    assert note == ("revised 'unlock-door-with-key' v2 -> v3 from 2 failing trajectories (the answer named it "
                    "'better-door-skill')")
    prompt = teacher.requests[0]["body"]["messages"][0]["content"]
    assert "NAME: unlock-door-with-key\nWHEN_TO_USE: When a door is locked.\nPROCEDURE:\n1. Unlock the door." in prompt
    assert "### Trajectory bad-2 (lost, return 0)" in prompt and "NAME must stay unlock-door-with-key" in prompt


def test_revise_skill_returns_none_with_the_reason():
    old = Skill("open-door", "When a door is closed.", "1. Open the door.\n2. Walk through.")
    failing = [trajectory("f1", won=False, ret=0.0)]
    same = ScriptedWriter(["NAME: open-door\nWHEN_TO_USE: Doors.\nPROCEDURE:\n1. Open the door.\n  2. Walk  through."])
    assert revise_skill(same, old, failing, round_index=1) == (
        None, "revision of 'open-door' from trajectories f1: the procedure is unchanged")
    revised, reason = revise_skill(ScriptedWriter(["no idea"]), old, failing, round_index=1)
    assert revised is None and reason.startswith("revision of 'open-door' from trajectories f1: unusable answer: "
                                                 "the answer has no NAME:")
    assert revise_skill(same, old, [], round_index=1) == (None, "no failing trajectories to revise 'open-door' from")
    with pytest.raises(ValueError, match=r"\['w'\] have won=True"):
        revise_skill(same, old, [trajectory("w")], round_index=1)


# ----------------------------------------------------------------------------------------------- the policy

def test_gateway_records_the_request_and_gibberish_is_reported(tmp_path, monkeypatch, long_context_engine):
    """Our gateway (create_app over a LocalEngineUpstream on the tiny policy) is the endpoint: the random policy
    answers gibberish, so nothing is mined, the reason is returned, and the pool holds the miner's request."""
    engine, tokenizer = long_context_engine
    monkeypatch.setenv(KEY_ENV, KEY)
    with DataPool(f"sqlite:///{tmp_path / 'pool.db'}") as pool:
        app = create_app(GatewayConfig(api_keys=(KEY,), policy_version="tiny-long-v0"), LocalEngineUpstream(engine),
                         pool, tokenizer)
        with ThreadedServer(app) as server:
            writer = ChatEndpointWriter(f"{server.url}/v1", "arlflow-policy", api_key_env=KEY_ENV, max_tokens=16,
                                        headers={"X-Env": "skill-miner", "X-Round": "3"})
            skills, failures = mine_llm_skills(writer, [trajectory("ep-1"), trajectory("ep-2")], round_index=3)
        assert skills == []
        assert len(failures) == 1 and failures[0].startswith("prompt 0 (trajectories ep-1, ep-2): unusable answer: ")
        (row,) = pool.query_trajectories(env="skill-miner")
        assert (row["round"], row["policy_version"]) == (3, "tiny-long-v0")
        (step,) = pool.get_trajectory(row["trajectory_id"]).steps
        assert MINE_INSTRUCTION in step.prompt_text and "### Trajectory ep-2 (won, return 1)" in step.prompt_text
        assert 1 <= len(step.response_ids) <= 16
        assert repr(step.response_text[:40])[1:-1] in failures[0]  # the reason quotes what the policy answered


def test_engine_writer_is_the_policy_itself(long_context_engine, tiny_policy_dir):
    engine, tokenizer = long_context_engine
    writer = EngineWriter(engine, tokenizer, max_new_tokens=12)
    prompt = render_trajectories([trajectory("e1")])
    text = writer.complete(prompt)
    assert isinstance(text, str) and text == writer.complete(prompt)  # greedy: the same text twice
    skills, failures = mine_llm_skills(writer, [trajectory("e1")], round_index=0)
    assert skills == [] and len(failures) == 1 and "unusable answer" in failures[0]
    model, short_tokenizer = load_policy(tiny_policy_dir)  # 256 positions: the miner prompt does not fit
    short = EngineWriter(TransformersEngine(model, short_tokenizer, policy_version="tiny-v0"), short_tokenizer)
    with pytest.raises(SkillWriterError, match=r"> the policy's context of 256 tokens: lower max_chars"):
        mine_llm_skills(short, [trajectory("e1")], round_index=0)
