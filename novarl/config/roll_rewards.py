"""ROLL's reward workers in novarl's terms (config/roll.py reads the rest of a pipeline config):
each `rewards.<domain>` block a reward domain routed by its `tag_included` -- the math rule the default
domain, the code sandbox, the CrossThinkQA and IFEval rules and the LLM judge novarl's registered
rewards (rewards/, rollout/judge.py) -- or refused in one line."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from novarl.config.files import show_value
from novarl.config.roll_devices import Translation
from novarl.config.roll_training import DTYPES


REWARD_WORKERS = {"MathRuleRewardWorker": "math_verify", "CodeSandboxRewardWorker": "code_tests",
                  "CrossThinkQARuleRewardWorker": "crossthinkqa", "GeneralRuleRewardWorker": "ifeval",
                  "LLMJudgeRewardWorker": "llm_judge"}
"""ROLL's reward workers -> novarl's registered rewards (the rule workers' reward_type picks a variant)."""
REWARD_KEYS = ("worker_cls", "tag_included", "model_args", "data_args", "world_size", "infer_batch_size",
               "reward_type", "response_length_penalty_coef", "use_local", "query_filter_config", "generating_args",
               "strategy_args", "device_mapping", "num_gpus_per_worker", "judge_prompt", "judge_model_type", "code_url")


def read_rewards(rewards: Any, out: Translation, taken: frozenset[int] = frozenset()) -> set[str]:
    """ROLL's reward workers as reward domains routed by their tags: the math rule is the default
    domain (ROLL sends rows of no listed tag to math_rule), the others reward.domains.<name>
    (`taken`: the devices of the policy's roles, which a judge does not share). The names of the
    workers refused."""
    if not isinstance(rewards, Mapping):
        return set()
    domains: dict[str, Any] = {}
    refused: set[str] = set()
    for name, block in rewards.items():
        block = block or {}
        worker = str(block.get("worker_cls", "")).rsplit(".", 1)[-1]
        function = REWARD_WORKERS.get(worker)
        if function is None:
            out.refuse(f"rewards.{name}.worker_cls", worker or None, f"not built yet (novarl has ROLL's "
                                                                     f"{', '.join(REWARD_WORKERS)})")
            refused.add(name)
            continue
        function = _reward_variant(name, block, function, out, taken)
        if function is None:
            refused.add(name)
            continue
        tags = [str(t) for t in block.get("tag_included") or []]
        if worker == "MathRuleRewardWorker":
            out.tree.setdefault("reward", {}).setdefault("function", function)
            out.set("reward.default_domain", name)
            chosen = show_value(out.tree["reward"]["function"])
            out.became.append(f"rewards.{name} ({worker}) -> reward.function={chosen}"
                              f", the default domain '{name}' (math-verify: 1 when the answer is right, else 0)")
        else:
            domains[name] = {"function": function, "tags": tags}
            out.became.append(f"rewards.{name} ({worker}) -> reward.domains.{name}: {function} on the examples "
                              f"tagged {', '.join(tags) or '(none)'}")
        unknown = set(block) - set(REWARD_KEYS)
        out.refused.extend(f"unknown key 'rewards.{name}.{k}'." for k in sorted(unknown))
    if domains:
        out.set("reward.domains", domains)
    return refused


def _reward_variant(name: str, block: Mapping[str, Any], function: str, out: Translation,
                    taken: frozenset[int]) -> str | None:
    """The registered reward for a worker's settings, or None (refused)."""
    if block.get("query_filter_config"):
        out.refuse(f"rewards.{name}.query_filter_config", block["query_filter_config"],
                   "filtering prompt groups by their rewards is not mapped; novarl's grpo.use_dynamic_sampling drops "
                   "the groups whose rewards are all equal")
        return None
    if function == "code_tests" and block.get("use_local", True) is not True:
        if not block.get("code_url"):
            out.refuse(f"rewards.{name}.use_local", block["use_local"], "a remote sandbox needs its code_url")
            return None
        out.set("reward.sandbox.url", block["code_url"])
    if function == "crossthinkqa":
        kind = block.get("reward_type", "soft")
        if kind not in ("loose", "soft", "strict"):
            out.refuse(f"rewards.{name}.reward_type", kind, "ROLL's CrossThinkQA rule has loose, soft and strict")
            return None
        if block.get("response_length_penalty_coef", 0.0) not in (0, 0.0, None):
            out.refuse(f"rewards.{name}.response_length_penalty_coef", block["response_length_penalty_coef"],
                       "a length penalty is not built; set it 0")
            return None
        return function if kind == "soft" else f"{function}_{kind}"
    if function == "llm_judge":
        return function if _judge(name, block, out, taken) else None
    if function == "ifeval" and "reward_type" in block:
        out.warnings.append(f"rewards.{name}.reward_type={show_value(block['reward_type'])}: ROLL's IFEval rule worker "
                            "does not read it, nor does novarl (1 when the check holds, plus the repetition penalty)")
    return function


JUDGE_PROMPTS = {"Qwen2.5-7B-Instruct-RLVR-prompt": "yes_no"}
"""ROLL's judge prompts -> novarl's templates asking the same (rollout/judge.py)."""
JUDGE_STRATEGIES = {"vllm": "vllm", "hf_infer": "hf"}
"""ROLL's strategies for a judge -> the engine of its own that runs it (reward.judge.backend)."""
JUDGE_GENERATING = {"max_new_tokens": "max_new_tokens", "top_p": "top_p", "top_k": "top_k",
                    "temperature": "temperature"}


def _judge(name: str, block: Mapping[str, Any], out: Translation, taken: frozenset[int]) -> bool:
    """ROLL's LLM judge block as reward.judge (one judge a run); False when refused."""
    where = f"rewards.{name}"
    if "judge" in out.tree.get("reward", {}):
        out.refused.append(f"'{where}': a second LLM judge; novarl runs one (reward.judge) a run.")
        return False
    kind, prompt = block.get("judge_model_type", "inference"), block.get("judge_prompt")
    if kind != "inference":
        out.refuse(f"{where}.judge_model_type", kind, "novarl's judge is a model it runs ('inference'); an API "
                                                       "or a shared cluster is not built")
        return False
    if prompt is not None and prompt not in JUDGE_PROMPTS:
        out.refuse(f"{where}.judge_prompt", prompt, f"novarl knows ROLL's {', '.join(JUDGE_PROMPTS)} (or give "
                                                     "reward.judge.prompt a template of your own)")
        return False
    model = block.get("model_args") or {}
    generating = block.get("generating_args") or {}
    strategy = (block.get("strategy_args") or {}).get("strategy_name", "hf_infer")
    backend = JUDGE_STRATEGIES.get(strategy)
    if backend is None or generating.get("num_beams", 1) != 1 or generating.get("num_return_sequences", 1) != 1:
        out.refuse(f"{where}.strategy_args.strategy_name", strategy, "the judge generates one greedy or sampled answer "
                                                                     f"with {' or '.join(JUDGE_STRATEGIES)}")
        return False
    judge = {"model_name": model.get("model_name_or_path"), "backend": backend,
             "prompt": JUDGE_PROMPTS.get(prompt, "yes_no"), "parser": "yes_no",
             **{ours: generating[theirs] for theirs, ours in JUDGE_GENERATING.items() if theirs in generating}}
    if model.get("dtype") in DTYPES:
        judge["precision"] = DTYPES[model["dtype"]]
    length = ((block.get("strategy_args") or {}).get("strategy_config") or {}).get("max_model_len")
    if length:
        judge["max_model_len"] = length
    out.set("reward.judge", {k: v for k, v in judge.items() if v is not None})
    _judge_devices(where, block, out, taken)
    return True


def _judge_devices(where: str, block: Mapping[str, Any], out: Translation, taken: frozenset[int]) -> None:
    """The judge's device_mapping: devices no role of the policy's uses become reward.judge.resources,
    counted in the cluster (as NeMo RL counts env.reward_model.resources); devices it shares with
    the policy's roles (ROLL time-shares them) leave the judge in the driver's process, said once."""
    from novarl.config.roll_devices import parse_devices

    mapping = block.get("device_mapping")
    shared = "its devices are the policy's too (ROLL time-shares them; novarl does not share a device between " \
             "the policy and a judge)"
    if mapping is not None:
        try:
            devices = parse_devices(mapping, f"{where}.device_mapping")
        except ValueError as err:
            out.refused.append(f"{err}.")
            return
        if not taken & set(devices):
            _count_judge_devices(where, devices, out)
            return
    else:
        shared = "it names no device_mapping"
    out.warnings.append(f"{where}: the LLM judge runs in the driver's process: {shared}; give it devices of its own "
                        "with reward.judge.resources (its world_size and strategy_config other than max_model_len "
                        "are not used)")


def _count_judge_devices(where: str, devices: tuple[int, ...], out: Translation) -> None:
    """Devices of the judge's own: reward.judge.resources, and the cluster grown to hold them."""
    from novarl.config.roll_devices import own_devices

    cluster = out.tree.get("cluster", {})
    per_node = int(cluster.get("gpus_per_node", 8))
    nodes = max(int(cluster.get("num_nodes", 1)), -(-(max(devices) + 1) // per_node))
    if not own_devices(out, "reward.judge.resources", len(devices), nodes, per_node):
        out.refused.append(f"'{where}.device_mapping': {len(devices)} devices on a {nodes}-node cluster; a judge "
                           f"on several nodes takes whole nodes ({per_node} devices each).")
        return
    out.set("cluster.num_nodes", nodes)
    out.became.append(f"{where}.device_mapping -> reward.judge.resources: {len(devices)} device(s) of its own, "
                      "apart from the policy's")
