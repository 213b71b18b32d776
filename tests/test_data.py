"""Datasets: the bundled task, JSONL and Parquet files, prompt batches."""

import json

import pytest

from novarl.config.schema import DataConfig
from novarl.data.arithmetic import arithmetic_examples
from novarl.data.datasets import PromptSampler, load_examples, read_examples, to_prompts
from novarl.errors import NotAvailableYet, UserError
from novarl.models.loading import load_tokenizer
from novarl.rewards.verifiers import exact_match


def test_arithmetic_splits_are_disjoint_and_fixed():
    train, val = arithmetic_examples("train"), arithmetic_examples("validation")
    assert (len(train), len(val)) == (7100, 1000)
    assert not {e.prompt for e in train} & {e.prompt for e in val}
    assert val == arithmetic_examples("validation")
    a, b = val[0].prompt[:-1].split("+")
    assert val[0].answer == str(int(a) + int(b))


def test_repeat_task_answers_run_from_2_to_40_tokens_in_fixed_splits():
    from novarl.config import load_config
    from novarl.data.datasets import load_examples

    cfg = load_config(None, overrides=["data.dataset_name=repeat"]).data
    train, val = load_examples(cfg, "train"), load_examples(cfg, "validation")
    assert (len(train), len(val)) == (1800, 200)
    assert not {e.prompt for e in train} & {e.prompt for e in val}
    digits, repeats = val[0].prompt[:-1].split("*")
    assert val[0].answer == digits * int(repeats)
    assert {len(e.answer) for e in train + val} == set(range(2, 41, 2))
    tokenizer = load_tokenizer("tiny-arith")
    longest = max(len(tokenizer(e.prompt + e.answer).input_ids) for e in train)
    assert longest + 1 <= 64  # + </s>: within the bundled model's positions


def test_exact_match():
    assert exact_match(" 95", "95") == 1.0
    assert exact_match("59", "95") == 0.0


def test_jsonl_and_parquet_rows(tmp_path):
    rows = [{"question": "1+1=", "solution": 2}, {"question": "2+2=", "solution": "4"}]
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    examples = read_examples(jsonl, "question", "solution")
    assert [(e.prompt, e.answer) for e in examples] == [("1+1=", "2"), ("2+2=", "4")]

    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"prompt": "3+4=", "answer": "7"}]), tmp_path / "d.parquet")
    cfg = DataConfig(train_data_path=str(tmp_path / "d.parquet"))
    assert [(e.prompt, e.answer) for e in load_examples(cfg, "train")] == [("3+4=", "7")]
    # No validation file: the training file is evaluated on.
    assert len(load_examples(cfg, "validation")) == 1


def test_bad_rows_are_reported_by_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": \n')
    with pytest.raises(UserError, match=r"bad.jsonl:2: not valid JSON"):
        read_examples(path, "prompt", "answer")
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n{"question": "2+2="}\n')
    with pytest.raises(UserError, match=r"bad.jsonl:2: no field 'prompt', 'answer' \(fields: question\)"):
        read_examples(path, "prompt", "answer")
    with pytest.raises(UserError, match="no such file"):
        read_examples(tmp_path / "missing.jsonl", "prompt", "answer")


def test_unknown_dataset_name_is_not_available_yet():
    with pytest.raises(NotAvailableYet, match="'NoSuchSet' is not a dataset novarl has.*OpenMathInstruct-2"):
        load_examples(DataConfig(dataset_name="NoSuchSet"), "train")


def test_prompts_are_tokenised_and_filtered_by_length():
    tokenizer = load_tokenizer("tiny-arith")
    examples = arithmetic_examples("validation")[:3]
    prompts = to_prompts(examples, tokenizer)
    assert prompts[0].token_ids == tokenizer(examples[0].prompt).input_ids
    assert prompts[0].token_ids[0] == tokenizer.bos_token_id and len(prompts[0].token_ids) == 7
    assert to_prompts(examples, tokenizer, max_prompt_tokens=6) == []


def test_sampler_walks_epochs_and_restores_its_position():
    tokenizer = load_tokenizer("tiny-arith")
    prompts = to_prompts(arithmetic_examples("validation")[:10], tokenizer)
    sampler = PromptSampler(prompts, 4, seed=1)
    first = [sampler.next_batch() for _ in range(3)]  # 4 + 4, then a new epoch
    assert sampler.epoch == 1
    assert len({p.index for p in first[0] + first[1]}) == 8
    state = sampler.state_dict()
    following = sampler.next_batch()
    restored = PromptSampler(prompts, 4, seed=1)
    restored.load_state_dict(state)
    assert restored.next_batch() == following
    with pytest.raises(UserError, match="fewer than grpo.num_prompts_per_step=11"):
        PromptSampler(prompts, 11, seed=1)


def test_bundled_task_names_agree_with_the_schema():
    from novarl.config.schema import BUNDLED_TASKS
    from novarl.data.datasets import BUNDLED_DATASETS

    assert set(BUNDLED_TASKS) == set(BUNDLED_DATASETS)


def test_import_novarl_stays_light():
    import subprocess
    import sys

    code = ("import sys, novarl; heavy = [m for m in ('torch', 'vllm', 'ray', 'deepspeed', 'megatron') "
            "if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_unreadable_inputs_are_user_errors(tmp_path, monkeypatch):
    from novarl.config import load_config
    from novarl.errors import ConfigError
    from novarl.rewards.registry import import_reward_fn

    latin = tmp_path / "latin.jsonl"
    latin.write_bytes('{"prompt": "caf\u00e9", "answer": "1"}\n'.encode("latin-1"))
    with pytest.raises(UserError, match="latin.jsonl: not UTF-8 text"):
        read_examples(latin, "prompt", "answer")
    bad_yaml = tmp_path / "c.yaml"
    bad_yaml.write_bytes("grpo: {seed: 1} # caf\u00e9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match="cannot be read as UTF-8"):
        load_config(bad_yaml)
    with pytest.raises(ConfigError, match=r"cannot parse the arguments of '\$\{mul:\[1,2\]\}'"):
        load_config(None, overrides=["grpo.max_num_steps=${mul:[1,2]}"])
    (tmp_path / "broken_reward_mod.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UserError, match="importing module 'broken_reward_mod' failed: RuntimeError: boom at import"):
        import_reward_fn("broken_reward_mod:score")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=r"the file '.*rewards\.py' does not exist"):
        import_reward_fn("./rewards.py:score")


def test_scalar_betas_is_a_config_error():
    import torch

    from novarl.backends.training.optim import build_optimizer
    from novarl.config.schema import OptimizerConfig
    from novarl.errors import ConfigError

    with pytest.raises(ConfigError, match="policy.optimizer: torch.optim.AdamW"):
        build_optimizer(OptimizerConfig(kwargs={"lr": 1e-3, "betas": 0.9}), [torch.nn.Parameter(torch.ones(1))])


# ------------------------------------------------------------ nested fields, chat messages
def test_dotted_keys_reach_nested_fields(tmp_path):
    path = tmp_path / "rows.jsonl"
    rows = [{"question": {"text": "3+4="}, "reward_model": {"ground_truth": 7, "style": "rule"}},
            {"question": {"text": "1+1="}, "reward_model": {"ground_truth": "2"}, "question.text": "literal"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    examples = read_examples(path, "question.text", "reward_model.ground_truth")
    # a column literally named with dots wins over the nested field
    assert [(e.prompt, e.answer) for e in examples] == [("3+4=", "7"), ("literal", "2")]
    with pytest.raises(UserError, match=r"rows.jsonl:1: no field 'reward_model.answer' \(reward_model has: "
                                        r"ground_truth, style\)"):
        read_examples(path, "question.text", "reward_model.answer")


def chat_tokenizer():
    """The bundled tokenizer with a chat template of its characters only: the messages' contents
    joined, system first (what a ChatML template does, minus the role tags the tiny vocabulary lacks)."""
    tokenizer = load_tokenizer("tiny-arith")
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    return tokenizer


def test_chat_message_prompts_are_rendered_by_the_chat_template(tmp_path):
    path = tmp_path / "chat.jsonl"
    rows = [{"prompt": [{"role": "system", "content": "1"}, {"role": "user", "content": "2+3="}], "answer": "5"},
            {"prompt": [{"role": "user", "content": "4+4="}], "answer": 8}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    examples = read_examples(path, "prompt", "answer")
    assert examples[1].prompt == ({"role": "user", "content": "4+4="},) and examples[1].answer == "8"
    prompts = to_prompts(examples, chat_tokenizer(), template="{}0", system_prompt="9")
    # the prompt file's template goes around the user's last turn; a system prompt is added where none is
    assert [p.text for p in prompts] == ["12+3=0", "94+4=0"]
    with pytest.raises(UserError, match="the tokenizer has no chat template"):
        to_prompts(examples, load_tokenizer("tiny-arith"))


@pytest.mark.parametrize("prompt, expected", [
    ([{"role": "user", "content": "1"}, {"role": "assistant", "content": "2"}], "must end with the user's message"),
    ([{"role": "narrator", "content": "1"}], r"'prompt'\[0\] must be a chat message"),
    ([], "must end with the user's message"),
    ({"role": "user"}, "must be a non-empty string or a list of chat messages"),
])
def test_bad_chat_messages_are_refused_by_row(tmp_path, prompt, expected):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": prompt, "answer": "1"}) + "\n")
    with pytest.raises(UserError, match=expected) as info:
        read_examples(path, "prompt", "answer")
    assert "bad.jsonl:1" in str(info.value)


def test_nemo_rl_chat_template_settings(tmp_path):
    from novarl.config import load_config

    examples = [type(arithmetic_examples("train")[0])(prompt="1+1=", answer="2")]
    plain = load_tokenizer("tiny-arith")  # no template of its own
    # 'default' (novarl's default, NeMo RL's unset key): the tokenizer's own, plain text without one
    assert to_prompts(examples, chat_tokenizer(), system_prompt="9")[0].text == "91+1="
    assert to_prompts(examples, plain, system_prompt="9")[0].text == "9\n1+1="
    # null: NeMo RL's pass-through template, the contents one after the other
    assert to_prompts(examples, plain, system_prompt="9", chat_template=None)[0].text == "91+1="
    # a template string with its arguments, or a file holding one
    jinja = "{% if enable_thinking %}0{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert to_prompts(examples, plain, chat_template=jinja, chat_template_kwargs={"enable_thinking": True})[0].text \
        == "01+1="
    (tmp_path / "t.jinja").write_text(jinja)
    assert to_prompts(examples, plain, chat_template=str(tmp_path / "t.jinja"))[0].text == "1+1="
    with pytest.raises(UserError, match="The chat template could not render a prompt"):
        to_prompts(examples, plain, chat_template="{% for m in messages %}{{ m['content'] }")
    cfg = load_config({"policy": {"tokenizer": {"chat_template": None,
                                                "chat_template_kwargs": {"enable_thinking": False}}}})
    assert cfg.policy.tokenizer.chat_template is None and cfg.load_warnings == ()
