"""TerminalEnv: tasks and verifiers, the expert, the command policy, the sandbox's containment, cleanup, determinism."""
from __future__ import annotations

import gc
import os
import shlex
import shutil
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from envs import ENVS, make_scenarios
from envs.scenarios import expert_trajectory
from envs.terminal import TerminalEnv
from envs.terminal_policy import PolicyError, Word, lex, parse
from envs.terminal_sandbox import Isolation, Limits, detect_isolation, run_command, run_pipeline
from envs.terminal_tasks import POOLS, TEMPLATES, make_task

CANARY = "CANARY-7f3e"


def fresh(template: str | None = None, seed: int = 0, split: str = "train", **kwargs) -> tuple[TerminalEnv, str]:
    env = TerminalEnv(**kwargs)
    options = {"split": split} | ({"template": template} if template else {})
    obs, _ = env.reset(seed=seed, options=options)
    return env, obs


def run_expert(env: TerminalEnv, limit: int = 30) -> dict:
    info: dict = {}
    for _ in range(limit):
        action = env.expert_action()
        assert action is not None
        _, _, terminated, truncated, info = env.step(action)
        if terminated or truncated:
            break
    return info


# ----------------------------------------------------------------------------------------------------- tasks
def test_registered_split_aware_with_bash_and_submit_tools():
    assert ENVS["terminal"] is TerminalEnv and TerminalEnv.split_aware is True
    names = [t["function"]["name"] for t in TerminalEnv.tools]
    assert names == ["bash", "submit"]
    assert TerminalEnv.tools[0]["function"]["parameters"]["required"] == ["command"]
    assert make_scenarios("terminal", "heldout", 1, seed=0)[0].options == (("split", "heldout"),)


@pytest.mark.parametrize("split", ["train", "heldout"])
@pytest.mark.parametrize("template", sorted(TEMPLATES))
def test_expert_solves_every_template(split, template):
    for seed in range(3):
        env, _ = fresh(template, seed, split)
        info = run_expert(env)
        assert info["won"] is True and info["tool_call"]["function"]["name"] == "submit"
        env.close()


def test_expert_wins_heldout_scenarios():
    for scenario in make_scenarios("terminal", "heldout", 20, seed=1):
        steps = expert_trajectory(scenario)
        assert steps[-1][2] == "submit"


def test_heldout_pools_are_disjoint_and_larger():
    train, held = POOLS["train"], POOLS["heldout"]
    for field in ("words", "names", "dirs", "needles"):
        assert not set(getattr(train, field)) & set(getattr(held, field))
    assert held.count[0] > train.count[1]
    words = train.words + held.words + train.needles + held.needles
    assert not [(a, b) for a in words for b in words if a != b and a in b]  # replace/grep tasks rely on it
    task = make_task(5, "heldout", "sort_lines")
    names = next(iter(task.files.values())).split()
    assert set(names) <= set(held.names) and len(names) >= 6


def wrong_commands(env: TerminalEnv) -> list[str]:
    """A plausible but wrong way to do the current task (hand-picked per template)."""
    task = env._task
    sol = task.solution
    wrong = {
        "create_file": lambda: sol[0].replace("echo ", "echo not"),
        "count_matches": lambda: sol[0].replace("grep -c " + sol[0].split()[2], "wc -l"),
        "rename_ext": lambda: sol[0].replace(".txt", ".text"),
        "find_word": lambda: f"cp {next(p for p in sorted(task.files) if p not in sol[0])} found.txt",
        "sort_lines": lambda: sol[0].replace("sort ", "sort -r "),
        "replace_word": lambda: sol[0].replace("s/", "s/zz", 1),
        "move_by_ext": lambda: sol[0],
        "first_lines": lambda: sol[0].replace("head -n ", "head -n 1"),
        "delete_tmp": lambda: f"rm -r {sol[0].split()[1]}",
        "count_unique": lambda: sol[0].replace(" | uniq", ""),
    }
    return [wrong[task.template]()]


@pytest.mark.parametrize("template", sorted(TEMPLATES))
def test_verifiers_reject_untouched_and_wrong_outcomes(template):
    for seed in range(2):
        env, _ = fresh(template, seed)
        assert env.step("submit")[1] == 0.0  # the initial state never verifies
        env, _ = fresh(template, seed)
        for command in wrong_commands(env):
            _, _, _, _, info = env.step(command)
            assert info["action_valid"], command
        obs, reward, terminated, _, info = env.step("submit")
        assert (reward, terminated, info["won"], obs) == (0.0, True, False, "submitted: task not complete")


def test_expert_restarts_after_deviation_and_cd():
    env, _ = fresh("rename_ext", seed=3)
    first = env.expert_action()
    env.step(first)
    assert env.expert_action() == env._task.solution[1]
    env.step("mkdir junk")  # a mutating detour: the plan restarts (re-running mv of a moved file just fails)
    assert env.expert_action() == first
    folder = first.split()[1].split("/")[0]
    env.step(f"cd {folder}")
    assert env.expert_action() == "cd /sandbox"
    assert run_expert(env)["won"] is True


# ----------------------------------------------------------------------------------------------------- actions
def test_tool_call_and_success_semantics():
    env, obs = fresh("count_matches", seed=1)
    assert obs.startswith("Files: ") and obs.endswith(".log")
    log = obs.split()[1]
    obs, reward, _, _, info = env.step(f"wc -l {log}")
    assert info["tool_call"] == {"type": "function",
                                 "function": {"name": "bash", "arguments": f'{{"command": "wc -l {log}"}}'}}
    assert (info["action_valid"], info["tool_success"], info["exit_code"], reward) == (True, True, 0, 0.0)
    obs, _, _, _, info = env.step("cat missing.txt")
    assert obs == "cat: missing.txt: No such file or directory\n[exit 1]"
    assert (info["action_valid"], info["tool_success"]) == (True, False)
    obs, _, _, _, info = env.step("cat /etc/passwd")
    assert obs.startswith("refused: ") and (info["action_valid"], info["tool_success"]) == (False, False)
    assert info["exit_code"] is None and info["sandbox"]["policy"] is True
    obs, _, _, _, info = env.step("mkdir d && cat /etc/passwd")  # a refused later segment: invalid, mkdir ran
    assert obs.startswith("refused: /etc/passwd") and not info["action_valid"]
    assert os.path.isdir(os.path.join(env._root, "d"))


def test_anchor_ignores_reads_and_returns_to_equal_states():
    env, _ = fresh("sort_lines", seed=2)
    start = env.step("ls")[4]["anchor"]
    touched = env.step("touch z.txt")[4]["anchor"]
    assert touched != start
    assert env.step("rm z.txt")[4]["anchor"] == start  # timestamps are not part of the state
    assert env.step("mkdir d && cd d")[4]["anchor"] != start  # the cwd is


def test_observation_is_truncated_and_full_verbosity_shows_the_prompt():
    env, _ = fresh(seed=0, max_output_chars=100)
    obs, _, _, _, _ = env.step("seq 1 1000")
    assert len(obs) == 100 and obs.startswith("1\n2\n") and obs.endswith("...[truncated]")
    env, _ = fresh(seed=0, verbosity="full")
    env.step("mkdir sub")
    env.step("cd sub")
    assert env.step("pwd")[0] == "/sandbox/sub$ pwd\n/sandbox/sub\n[exit 0]"


def test_max_steps_truncates_and_bad_input_raises():
    env, _ = fresh(max_steps=2)
    assert env.step("ls")[3] is False
    _, _, terminated, truncated, info = env.step("ls")
    assert (terminated, truncated, info["won"]) == (False, True, False)
    with pytest.raises(RuntimeError, match="reset"):
        env.step("ls")
    for options, word in (({"size": 3}, "template"), ({"split": "dev"}, "heldout"), ({"template": "x"}, "sort_lines")):
        with pytest.raises(ValueError, match=word):
            TerminalEnv().reset(seed=0, options=options)
    with pytest.raises(ValueError, match="verbosity"):
        TerminalEnv(verbosity="loud")


# ----------------------------------------------------------------------------------------------------- lexing
def test_lex_quotes_operators_and_globs():
    words = lex("echo \"a b\" c\\ d 'e *' f*|sort>>out")
    assert words == [Word("echo"), Word("a b"), Word("c d"), Word("e *"), Word("f*", "f*"), "|", Word("sort"),
                     ">>", Word("out")]
    assert [len(s.stages) for s in parse("cat a | sort && wc -l < a > n")] == [2, 1]
    for bad, why in (("ls; id", "&&"), ("ls || id", "||"), ("ls &", "&&"), ("echo $(id)", "substitution"),
                     ("echo ${HOME}", "variables"), ("echo `id`", "backticks"), ("cat <(ls)", "redirections"),
                     ("ls 2>/dev/null", "stderr"), ("echo 'x", "quote"), ("ls\nid", "newlines"),
                     ("cat a | mv a b", "pipeline"), ("cd .. | ls", "alone")):
        with pytest.raises(PolicyError, match=why):
            parse(bad)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), min_size=1), min_size=1,
                max_size=6))
def test_lex_words_match_shlex(words):
    """Operator-free input: our lexer gives the same words as shlex.split (POSIX quoting)."""
    line = " ".join(shlex.quote(w) for w in words)
    assert [w.text for w in lex(line)] == shlex.split(line) == words


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(["a", "b", ".", "/", "*", "'", '"', "|", "&", ";", "<", ">", "$", "`", "\\", " ",
                                 "-", "\x00", "\n", "ls", "cat", "sed", "grep", "find", "-exec", "ln -s", "cd", "..",
                                 "/etc", "/sandbox"]), max_size=12).map("".join))
def test_arbitrary_text_never_raises(text):
    env, _ = fresh(seed=0, command_timeout_s=0.3)
    obs, reward, _, _, info = env.step(text)
    assert isinstance(obs, str) and obs and isinstance(info["action_valid"], bool) and reward == 0.0
    env.close()


# ----------------------------------------------------------------------------------------------------- escapes
@pytest.fixture()
def jailed(open_dir):
    """An env whose sandbox sits at open_dir/box/<temp>, with canaries at open_dir/secret and open_dir/x."""
    for name in ("secret", "x"):
        (open_dir / name).write_text(CANARY + "\n")
    (open_dir / "box").mkdir()
    env, _ = fresh(template="find_word", seed=0, base_dir=str(open_dir / "box"), command_timeout_s=0.5,
                   max_steps=500)
    yield env, open_dir
    env.close()


def assert_contained(env, tmp_path, command):
    obs, _, _, _, info = env.step(command)
    assert CANARY not in obs and "root:x:" not in obs and "arlflow-terminal" not in obs, (command, obs)
    assert not info["action_valid"] or info["exit_code"] != 0 or "removed symlink" in obs or command == "ls", \
        (command, obs)
    assert (tmp_path / "secret").read_text() == CANARY + "\n" and (tmp_path / "x").read_text() == CANARY + "\n"
    assert not (tmp_path / "owned").exists() and not os.path.exists("/tmp/owned-by-terminal-test")
    return obs, info


ESCAPES = [
    "cd ..", "ls", "cat /etc/passwd", "cat ../../secret", "cat /sandbox/../../secret", "ln -s / root",
    "ln -s / root && cat root/etc/passwd", "ln -s /etc e", "ln -s ../../.. up", "curl http://example.com",
    "python -c 'print(1)'", "python3 -c 'print(1)'", "bash -c ls", "sh", "env", "echo $(cat /etc/passwd)",
    "echo `cat /etc/passwd`", "echo x > /tmp/owned-by-terminal-test", "find / -name x", "find .. -name secret",
    "sed -n 'w /tmp/owned-by-terminal-test' found.txt", "sed 'r /etc/passwd' found.txt", "sed 'e id' found.txt",
    "sed -i.bak s/a/b/ x", "sed -f /etc/passwd x", "grep -f /etc/passwd x", "grep -R CANARY ..", "grep -r CANARY ..",
    "cat ../*", "echo ../*", "cp ../../secret s", "sort -o ../../owned x", "tail -f x", "diff ../../secret x",
    "test -f ../../secret", "touch -r ../../secret x", "cat -- ../../secret", "cat '../../secret'",
    "find . -exec cat ../../secret {} +", "cat < ../../secret", "ls > ../../owned", "ls -L", "cp -L a b",
    "test ../../secret -nt x", "[ -b /dev/sda ]", "[ -e /etc/passwd ]", "cat 'a\x00b'", "cat " + "a" * 3000,
]


def test_escape_attempts_are_refused_or_contained(jailed):
    env, tmp_path = jailed
    for command in ESCAPES:
        assert_contained(env, tmp_path, command)
    obs, info = assert_contained(env, tmp_path, "cd ..")
    assert info["cwd"] == "/sandbox" and not info["action_valid"]


def test_planted_and_moved_symlinks_never_leak(jailed):
    env, tmp_path = jailed
    os.symlink(tmp_path / "secret", os.path.join(env._root, "planted"))
    os.symlink(tmp_path, os.path.join(env._root, "pdir"))
    for command in ("cat planted", "cat pdir/secret", "grep -r CANARY .", "ls pdir", "cat planted"):
        assert_contained(env, tmp_path, command)
    assert not os.path.lexists(os.path.join(env._root, "planted"))
    # a link that points inside where it is, then moved so its relative target escapes: removed after the command
    _, info = assert_contained(env, tmp_path, "mkdir -p a/b && ln -s ../../x a/b/l && cat a/b/l")
    assert info["action_valid"]
    obs, _ = assert_contained(env, tmp_path, "mv a/b/l l2")
    assert "removed symlink l2" in obs
    assert_contained(env, tmp_path, "cat l2")


def test_ln_over_a_link_to_a_directory_is_checked_where_the_link_lands(jailed):
    """``ln -sfn T L`` replaces the link L itself (-n): T resolves from L's folder, not from where L points."""
    env, tmp_path = jailed
    assert env.step("mkdir -p a/b && ln -s a/b L")[4]["action_valid"]
    obs, info = assert_contained(env, tmp_path, "ln -sfn ../../x L")  # before: allowed (checked from a/b/x)
    assert obs.startswith("refused: ln -s: ../../x would point outside") and not info["action_valid"]
    assert os.readlink(os.path.join(env._root, "L")) == "a/b"
    assert env.step("ln -sfn a L")[4]["exit_code"] == 0 and os.readlink(os.path.join(env._root, "L")) == "a"
    assert env.step("ln -sf ../x L")[4]["exit_code"] == 0  # without -n: made inside a (a/x -> ../x, inside)
    assert os.readlink(os.path.join(env._root, "a", "x")) == "../x"


def test_runaway_commands_hit_limits_and_the_episode_goes_on(tmp_path):
    env, _ = fresh(seed=0, command_timeout_s=0.5, max_file_bytes=64 * 1024)
    obs, _, _, _, info = env.step("yes > big.txt")
    assert "file size limit (64 KiB)" in obs and info["tool_success"] is False
    assert os.path.getsize(os.path.join(env._root, "big.txt")) == 64 * 1024
    start = time.monotonic()
    obs, _, terminated, _, info = env.step("sleep 100")
    assert time.monotonic() - start < 2.0 and "timed out after 0.5s" in obs and info["exit_code"] == 124
    assert not terminated and env.step("pwd")[0] == "/sandbox"
    obs, _, _, _, _ = env.step("yes")
    assert obs.endswith("...[truncated]")
    env, _ = fresh(seed=0, max_file_bytes=64 * 1024, disk_quota_bytes=100 * 1024)
    env.step("yes > a")
    obs, reward, terminated, _, info = env.step("cp a b")
    assert terminated and "quota" in obs and (reward, info["won"]) == (0.0, False)


def test_runner_has_no_network_drops_privileges_and_caps_memory(open_dir):
    tmp_path = open_dir
    iso = detect_isolation()
    limits = Limits(timeout_s=2.0, memory_bytes=64 * 2**20, processes=4)
    env = {"PATH": "/usr/bin:/bin", "LC_ALL": "C"}
    if iso.netns:
        out = run_pipeline([("cat", "/proc/net/dev")], str(tmp_path), env, limits, iso).output.decode()
        assert [line.split(":")[0].strip() for line in out.splitlines()[2:]] == ["lo"]
    if iso.uid is not None:
        assert run_pipeline([("id", "-u")], str(tmp_path), env, limits, iso).output.decode().strip() == str(iso.uid)
    if shutil.which("python3", path="/usr/bin:/bin"):
        result = run_pipeline([("python3", "-c", "x = bytearray(10**9)")], str(tmp_path), env, limits, iso)
        assert result.exit_code != 0 and b"MemoryError" in result.output
    result = run_pipeline([("bash", "-c", "for i in 1 2 3 4 5 6 7 8; do sleep 1 & done; wait")], str(tmp_path),
                          env, Limits(timeout_s=0.5, processes=4), iso)
    assert b"Resource temporarily unavailable" in result.output or iso.uid is None


@pytest.mark.parametrize("iso", [Isolation(launcher=False, netns=True, uid=65534, gid=65534),
                                 Isolation(netns=True, userns=True)], ids=["preexec", "userns"])
def test_other_isolation_variants_run_and_limit(open_dir, iso):
    tmp_path = open_dir
    if os.geteuid() != 0 and iso.uid is not None:
        pytest.skip("the uid drop variant needs root")
    root = str(tmp_path.resolve())
    result = run_command("seq 1 3 | wc -l", root, "", Limits(), iso)
    if result.exit_code != 0:
        pytest.skip(f"isolation variant unavailable here: {result.output}")
    assert result.output == "3\n"
    assert "file size limit" in run_command("yes > big", root, "", Limits(file_bytes=4096), iso).output


# ----------------------------------------------------------------------------------------------------- lifecycle
def test_sandbox_dirs_are_removed_on_reset_close_and_gc(open_dir):
    tmp_path = open_dir
    env = TerminalEnv(base_dir=str(tmp_path))
    env.reset(seed=0)
    first = env._root
    env.reset(seed=1)
    assert not os.path.exists(first) and os.path.isdir(env._root)
    second = env._root
    env.close()
    assert not os.path.exists(second)
    env.reset(seed=2)
    third = env._root
    del env
    gc.collect()
    assert not os.path.exists(third) and os.listdir(tmp_path) == []


def play(seed: int) -> list:
    env, obs = fresh(seed=seed, command_timeout_s=0.3)
    out = [obs, env.task_description()]
    for command in ("ls -R", "find . -type f", "grep -rn a .", "mkdir -p q/r && cd q/r && pwd", "cat nope",
                    "cd /sandbox", "echo *", "sleep 5", "cat /etc/passwd", "wc -c *"):
        obs, reward, terminated, truncated, info = env.step(command)
        out.append((obs, reward, terminated, truncated, info["anchor"], info["exit_code"]))
        assert env._root not in obs
    return out


def test_same_seed_same_files_and_transcript():
    assert play(7) == play(7)
    assert play(7)[:2] != play(8)[:2]


def test_commands_are_fast():
    env, _ = fresh(seed=0, max_steps=100)
    env.step("ls")
    start = time.perf_counter()
    for _ in range(20):
        env.step("ls")
        env.expert_action()
    assert (time.perf_counter() - start) / 20 < 0.1
