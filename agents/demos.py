"""Expert demonstrations for warm-start SFT: each env solver's steps as (prompt, response) pairs.

Prompts are rendered exactly as the rollout loop renders them (agents/rollout.py: same template, context manager,
skill slot and admissible actions), so SFT trains on the text the policy later sees; the expert may call a shown
macro instead of spelling out its actions (``call_macros``).
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from agents.context import Turn, expert_fold_response, get_context_manager
from agents.rollout import EnvKwargs, SkillQuery, SkillSlot, SkillsFor, as_slot, check_env_kwargs, with_macros
from agents.templates import encode_prompt, render_prompt, response_text, template_for
from envs.base import Scenario
from envs.scenarios import expert_steps
from skills.mdl import macro_slots, match_macro


def expert_demonstrations(tokenizer: Any, scenarios: list[Scenario], *, context: str = "window",
                          history_turns: int = 0, skills_for: SkillsFor | None = None,
                          env_kwargs: EnvKwargs | None = None, require_win: bool = True,
                          tool_format: str = "text", skills_per_step: bool = False, call_macros: bool = False,
                          chat_template: bool = False) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, response ids) per expert step of every scenario, for warm-start SFT.

    Prompts are built exactly as in ``run_episodes``; a response is ``" " + action`` followed by eos (with fold,
    the expert opens and closes the env's own subgoals with tags; with ``tool_format="openai"`` tool envs' actions
    are written as JSON tool calls). Raises ValueError for a scenario the env's solver cannot solve.
    """
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise ValueError("the tokenizer has no eos_token_id: set one (e.g. eos_token='<|endoftext|>') so responses "
                         "can end")
    pairs: list[tuple[list[int], list[int]]] = []
    for prompt, response in expert_texts(scenarios, context=context, history_turns=history_turns,
                                         skills_for=skills_for, env_kwargs=env_kwargs, require_win=require_win,
                                         tool_format=tool_format, skills_per_step=skills_per_step,
                                         call_macros=call_macros):
        pairs.append((encode_prompt(tokenizer, prompt, chat=chat_template),
                      tokenizer.encode(response, add_special_tokens=False) + [eos]))
    return pairs


def expert_texts(scenarios: Sequence[Scenario], *, context: str = "window", history_turns: int = 0,
                 skills_for: SkillsFor | None = None, env_kwargs: EnvKwargs | None = None,
                 require_win: bool = True, tool_format: str = "text", skills_per_step: bool = False,
                 call_macros: bool = False) -> list[tuple[str, str]]:
    """(prompt text, response text) per expert step: what ``expert_demonstrations`` tokenizes.

    With ``call_macros`` (not with fold), whenever a macro in the skill slot instantiates to the expert's next
    actions, the demonstration calls it instead (``" skill 1 apple 1 fridge 1"``) and continues after them: the
    policy learns to call a shown macro when it is what it would do anyway (skills/mdl.py match_macro).
    """
    manager = get_context_manager(context)
    kwargs_by_env = check_env_kwargs(env_kwargs)
    out: list[tuple[str, str]] = []
    for scenario in scenarios:
        template = template_for(scenario.env)
        slot = SkillSlot("")
        turns: list[Turn] = []
        open_index: int | None = None
        steps = list(expert_steps(scenario, require_win=require_win, **kwargs_by_env.get(scenario.env, {})))
        position, turn = 0, 0
        while position < len(steps):
            step = steps[position]
            if skills_for is not None and (turn == 0 or skills_per_step):
                slot = as_slot(skills_for(SkillQuery(scenario, step.task, step.observation, turn)))
            call = (_expert_macro_call(slot.macros, [s.action for s in steps[position:]])
                    if call_macros and context != "fold" else None)
            prompt = render_prompt(template, step.task, manager(turns, history_turns), step.observation,
                                   admissible=with_macros(step.info.get("admissible_actions"), slot.macros),
                                   skills_text=slot.text)
            if call is not None:
                keyword, arguments, length = call
                response, shown = " " + " ".join([keyword, *arguments]), keyword
            else:
                response = response_text(step.action, tool_format=tool_format, template=template)
                shown, length = step.action, 1
                names, done = step.info.get("subgoals"), step.info.get("subgoals_done")
                if context == "fold" and names and done is not None:
                    tagged, open_index = expert_fold_response(response.strip(), names, int(done), open_index)
                    response = " " + tagged
            out.append((prompt, response))
            turns.append(Turn(step.observation, response, shown, step.info.get("subgoals_done")))
            position += length
            turn += 1
    return out


def _expert_macro_call(macros: Mapping[str, Sequence[str]], upcoming: Sequence[str]
                       ) -> tuple[str, list[str], int] | None:
    """(keyword, arguments, steps covered) of the longest shown macro that instantiates to the next actions."""
    for keyword, macro in sorted(macros.items(), key=lambda item: (-len(item[1]), item[0])):
        if len(macro) <= len(upcoming):
            bindings = match_macro(list(macro), list(upcoming[:len(macro)]))
            if bindings is not None:
                return keyword, [bindings[slot] for slot in macro_slots(list(macro))], len(macro)
    return None
