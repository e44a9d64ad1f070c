"""Modules that import nothing of arlflow (only the standard library and torch), so that vLLM's own venv can load
them: the action prefix tree of constrained decoding (action_trie) and vLLM's logits processor over it
(arlflow_action_trie, which also imports vllm and is only ever imported by the vLLM servers)."""
