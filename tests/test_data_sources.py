"""Where rows come from: data files of every format, folders `datasets` saved, folders laid out
as hub repositories, hub dataset ids from the hub cache or `datasets`' prepared cache, and
NeMo RL's named datasets. Nothing reaches the network: hub caches are made in tmp_path."""

from __future__ import annotations

import json
import shutil

import pyarrow as pa
import pytest

from novarl.config import load_config
from novarl.config.schema import DataConfig
from novarl.data.datasets import load_examples
from novarl.data.sources import NotInCache, locate, split_files
from novarl.errors import UserError
from novarl.data.checks import data_problems
from tests.helpers.hub import cache_snapshot, parquet_bytes

ROWS = [{"question": f"{a}+{a}=", "solution": str(2 * a), "level": a % 3} for a in range(1, 5)]


def answers(cfg: DataConfig, split: str = "train") -> list[str]:
    return [e.answer for e in load_examples(cfg, split)]


def test_every_file_format_reads_the_same_rows(tmp_path):
    import pyarrow.csv as pcsv
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist(ROWS)
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (tmp_path / "d.json").write_text(json.dumps(ROWS, indent=2))  # one JSON array
    pq.write_table(table, tmp_path / "d.parquet")
    pcsv.write_csv(table, tmp_path / "d.csv")
    with pa.OSFile(str(tmp_path / "d.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    for name in ("d.jsonl", "d.json", "d.parquet", "d.csv", "d.arrow"):
        examples = load_examples(DataConfig(train_data_path=str(tmp_path / name), input_key="question",
                                            output_key="solution"), "train")
        assert [(e.prompt, e.answer) for e in examples] == [(r["question"], r["solution"]) for r in ROWS], name
        # the row's other fields stay with the example, for the reward (not the prompt's); CSV's are text
        assert examples[0].columns == {"solution": "2", "level": "1" if name == "d.csv" else 1}, name


def test_a_json_file_that_is_neither_rows_nor_an_array_is_refused(tmp_path):
    (tmp_path / "d.json").write_text('[{"prompt": "1+1=", "answer": "2"},')
    with pytest.raises(UserError, match=r"d.json: not valid JSON"):
        load_examples(DataConfig(train_data_path=str(tmp_path / "d.json")), "train")
    (tmp_path / "d.parquet").write_text("not parquet")
    with pytest.raises(UserError, match=r"d.parquet: not a readable parquet file"):
        load_examples(DataConfig(train_data_path=str(tmp_path / "d.parquet")), "train")


def test_a_file_has_no_splits(tmp_path):
    (tmp_path / "d.jsonl").write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    with pytest.raises(UserError, match=r"data.train_data_path='.*d.jsonl' is one file, which has no split 'test'"):
        load_examples(DataConfig(train_data_path=str(tmp_path / "d.jsonl"), train_split="test"), "train")


def test_folders_saved_by_datasets(tmp_path):
    import datasets

    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(6)]
    whole = datasets.Dataset.from_list(rows)
    datasets.DatasetDict({"train": whole.select(range(4)), "test": whole.select([4, 5])}).save_to_disk(
        str(tmp_path / "dict"))
    whole.save_to_disk(str(tmp_path / "one"))
    cfg = DataConfig(train_data_path=str(tmp_path / "dict"))
    assert answers(cfg) == ["1", "2", "3", "4"]
    # no validation source given: the dataset's test split is held out
    assert answers(cfg, "validation") == ["5", "6"]
    assert answers(DataConfig(train_data_path=str(tmp_path / "dict"), train_split="test")) == ["5", "6"]
    with pytest.raises(UserError, match=r"has no split 'dev' \(it has: train, test\)"):
        load_examples(DataConfig(train_data_path=str(tmp_path / "dict"), train_split="dev"), "train")
    assert answers(DataConfig(train_data_path=str(tmp_path / "one"))) == [r["answer"] for r in rows]


def test_hub_layout_folders_split_by_card_or_by_name(tmp_path):
    folder = tmp_path / "repo"
    (folder / "data").mkdir(parents=True)
    for name, rows in (("train", ROWS[:3]), ("test", ROWS[3:])):
        (folder / "data" / f"{name}-00000-of-00001.parquet").write_bytes(parquet_bytes(rows))
    keys = dict(input_key="question", output_key="solution")
    # no card: the split names in the file names decide
    assert answers(DataConfig(train_data_path=str(folder), **keys)) == ["2", "4", "6"]
    assert answers(DataConfig(train_data_path=str(folder), **keys), "validation") == ["8"]
    # a card's configs decide, subsets included
    (folder / "README.md").write_text("---\nconfigs:\n- config_name: main\n  data_files:\n  - split: train\n"
                                      "    path: data/test-*\n- config_name: other\n  data_files: data/train-*\n---\n")
    with pytest.raises(UserError, match=r"has several subsets \(main, other\): name one"):
        load_examples(DataConfig(train_data_path=str(folder), **keys), "train")
    assert answers(DataConfig(train_data_path=str(folder), subset="main", **keys)) == ["8"]
    assert answers(DataConfig(train_data_path=str(folder), subset="other", **keys)) == ["2", "4", "6"]
    with pytest.raises(UserError, match=r"has no subset 'socratic' \(it has: main, other\)"):
        load_examples(DataConfig(train_data_path=str(folder), subset="socratic", **keys), "train")


def test_split_names_follow_the_hub_rules():
    names = ["data/train_1M-00000-of-00001.parquet", "data/validation.jsonl", "eval/part0.jsonl", "notes.jsonl"]
    assert split_files(names, None, None, None, ("train",), "x") == ("train", [names[0]])
    assert split_files(names, None, None, None, ("validation",), "x")[1] == [names[1]]
    assert split_files(names, None, "test", None, ("train",), "x")[1] == [names[2]]
    # no split name anywhere: every file is "train"
    assert split_files(["a.jsonl", "b/c.parquet"], None, None, None, ("train",), "x")[1] == ["a.jsonl", "b/c.parquet"]
    # 'training' counts as train; 'constrain' does not
    assert split_files(["training.jsonl", "constrain.jsonl"], None, "train", None, ("train",), "x")[1] == \
        ["training.jsonl"]


def test_a_hub_id_reads_the_hub_cache_and_missing_shards_are_not_a_split(hub_cache, monkeypatch):
    cache_snapshot(hub_cache, "someorg/mathset", {
        "data/train-00000-of-00002.parquet": parquet_bytes(ROWS[:2]),
        "data/train-00001-of-00002.parquet": parquet_bytes(ROWS[2:]),
        "README.md": b"# no configs\n"}, repo_type="dataset")
    cfg = DataConfig(train_data_path="someorg/mathset", input_key="question", output_key="solution")
    assert answers(cfg) == ["2", "4", "6", "8"]
    assert data_problems(cfg) == ([], [])
    source = locate("someorg/mathset", "w")
    assert "from the hub cache" in source.label and len(source.files) == 2
    cache_snapshot(hub_cache, "someorg/partial", {"data/train-00000-of-00002.parquet": parquet_bytes(ROWS)},
                   repo_type="dataset")
    with pytest.raises(NotInCache, match=r"1 of the 2 shards of 'data/train' are here"):
        locate("someorg/partial", "w")
    problems, notes = data_problems(DataConfig(train_data_path="someorg/partial"))
    assert problems == [] and notes == ["data.train_data_path='someorg/partial': 1 of the 2 shards of "
                                        "'data/train' are here. `novarl train` downloads it."]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    problems, notes = data_problems(DataConfig(train_data_path="someorg/partial"))
    assert [str(p) for p in problems] == ["data.train_data_path='someorg/partial': 1 of the 2 shards of 'data/train' "
                                          "are here. HF_HUB_OFFLINE is set, so `novarl train` cannot download it."]


def test_a_hub_id_reads_what_datasets_prepared(hub_cache, tmp_path, monkeypatch):
    import datasets

    # datasets.load_dataset("someorg/prepared") leaves <cache>/someorg___prepared/default/0.0.0/<hash>/
    # prepared-<split>.arrow (IPC streams) with dataset_info.json naming the splits.
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "ds_cache"))
    prepared = tmp_path / "ds_cache" / "someorg___prepared" / "default" / "0.0.0" / "abc123"
    prepared.mkdir(parents=True)
    for split, rows in (("train", ROWS[:3]), ("test", ROWS[3:])):
        datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / split))
        shutil.copy(tmp_path / split / "data-00000-of-00001.arrow", prepared / f"prepared-{split}.arrow")
    (prepared / "dataset_info.json").write_text(json.dumps({"splits": {"train": {}, "test": {}}}))
    cfg = DataConfig(train_data_path="someorg/prepared", input_key="question", output_key="solution")
    assert answers(cfg) == ["2", "4", "6"] and answers(cfg, "validation") == ["8"]


def test_an_uncached_hub_id_is_downloaded_by_train_and_an_unreachable_hub_says_so(hub_cache, monkeypatch):
    cfg = DataConfig(train_data_path="someorg/elsewhere")
    problems, notes = data_problems(cfg)
    assert problems == [] and len(notes) == 1 and "`novarl train` downloads it" in notes[0]
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: refused at once
    with pytest.raises(UserError, match=r"'someorg/elsewhere': the hub dataset is in no local cache, and the hub at "
                                        r"http://127.0.0.1:9 cannot be reached"):
        load_examples(cfg, "train")


def test_nemo_rl_named_datasets_read_their_hub_fields(hub_cache, tmp_path):
    dapo = [{"prompt": [{"role": "user", "content": f"Solve {i}+{i}."}], "reward_model": {"ground_truth": str(2 * i)},
             "data_source": "math"} for i in range(3)]
    cache_snapshot(hub_cache, "BytedTsinghua-SIA/DAPO-Math-17k", {"data/dapo-math-17k.parquet": parquet_bytes(dapo)},
                   repo_type="dataset")
    cache_snapshot(hub_cache, "HuggingFaceH4/aime_2024", {"data/train-00000-of-00001.parquet": parquet_bytes(
        [{"problem": "AIME?", "answer": "204", "id": 60}])}, repo_type="dataset")
    gsm8k_card = (b"---\nconfigs:\n- config_name: main\n  data_files:\n  - split: train\n    path: main/train-*\n"
                  b"  - split: test\n    path: main/test-*\n- config_name: socratic\n  data_files:\n"
                  b"  - split: train\n    path: socratic/train-*\n---\n")
    gsm8k_rows = parquet_bytes([{"question": "2+2?", "answer": "2 and 2 make 4.\n#### 4"}])
    cache_snapshot(hub_cache, "openai/gsm8k",
                   {"README.md": gsm8k_card, "main/train-00000-of-00001.parquet": gsm8k_rows}, repo_type="dataset")
    # NeMo RL's blocks: the DAPO recipe trains on DAPOMath17K and evaluates on AIME2024
    cfg = load_config({"data": {"train": {"dataset_name": "DAPOMath17K"}, "validation": {"dataset_name": "AIME2024"}}})
    assert (cfg.data.dataset_name, cfg.data.val_dataset_name) == ("DAPOMath17K", "AIME2024")
    train = load_examples(cfg.data, "train")
    assert [(e.prompt, e.answer) for e in train] == [("Solve 0+0.", "0"), ("Solve 1+1.", "2"), ("Solve 2+2.", "4")]
    assert train[0].columns["data_source"] == "math"
    assert [(e.prompt, e.answer) for e in load_examples(cfg.data, "validation")] == [("AIME?", "204")]
    # GSM8K's answer is what follows '####'
    assert [e.answer for e in load_examples(DataConfig(dataset_name="GSM8K"), "train")] == ["4"]
    # a named dataset and a path for the same split are one source too many
    with pytest.raises(Exception, match="names a dataset, but data.train_data_path is also set"):
        load_config({"data": {"dataset_name": "DAPOMath17K", "train_data_path": str(tmp_path / "x.jsonl")}})


def test_several_datasets_train_as_one_pool_and_evaluate_on_held_out_parts_and_their_own(tmp_path):
    def rows(name: str, start: int, count: int, key: str = "prompt") -> str:
        path = tmp_path / name
        path.write_text("".join(json.dumps({key: f"{i}+1=", "answer": str(i + 1)}) + "\n"
                                for i in range(start, start + count)))
        return str(path)

    a, b, v = rows("a.jsonl", 0, 10), rows("b.jsonl", 100, 4, key="question"), rows("v.jsonl", 500, 2)
    cfg = load_config({"data": {"train": [{"data_path": a, "split_validation_size": 0.2},
                                          {"data_path": b, "input_key": "question"}],
                                "validation": [{"data_path": v}]}}).data
    train, val = load_examples(cfg, "train", seed=3), load_examples(cfg, "validation", seed=3)
    assert len(train) == 8 + 4 and len(val) == 2 + 2
    assert {e.answer for e in train} & {e.answer for e in val} == set()  # a's held-out rows are not trained on
    assert {"101", "104"} <= {e.answer for e in train} and {"501", "502"} <= {e.answer for e in val}
    with pytest.raises(Exception, match="data.train lists the datasets, and data.train_data_path names one too"):
        load_config({"data": {"train": [{"data_path": a}], "train_data_path": a}})
    with pytest.raises(Exception, match="names its data with dataset_name .* or data_path, one of them"):
        load_config({"data": {"train": [{"input_key": "q"}]}})


def test_nemo_rl_multiple_datasets_config_validates_as_written(hub_cache, capsys, monkeypatch):
    from pathlib import Path

    from novarl.cli import main

    monkeypatch.chdir(hub_cache)
    recipe = Path(__file__).parent / "data" / "nemo_rl" / "2026-08" / "grpo_multiple_datasets.yaml"
    cfg = load_config(recipe)
    assert [b.dataset_name for b in cfg.data.train] == ["OpenMathInstruct-2", "DeepScaler"]
    assert cfg.data.train[0].split_validation_size == 0.05 and cfg.data.validation[0].repeat == 16
    assert cfg.reward.function == "math_verify"
    assert main(["validate", str(recipe)]) == 0
    out = capsys.readouterr().out
    assert "data.validation[0].repeat=16: each example is evaluated once; grpo.val_num_generations_per_prompt" in out
    assert "data.train[1].dataset_name='DeepScaler' (hub dataset 'agentica-org/DeepScaleR-Preview-Dataset'): " \
           "it is in no local cache" in out


def test_roll_several_files_are_one_pool_sampled_by_domain():
    from novarl.config.roll import from_roll

    base = {"actor_train": {"strategy_args": {"strategy_name": "fsdp2_train"},
                            "data_args": {"file_name": ["a.jsonl", "b.jsonl"], "messages": "messages"}}}
    assert from_roll(base).tree["data"]["train"] == [{"data_path": "a.jsonl"}, {"data_path": "b.jsonl"}]
    base["actor_train"]["data_args"]["domain_interleave_probs"] = {"math": 0.6, "code": 0.4}
    assert from_roll(base).tree["data"]["domain_interleave_probs"] == {"math": 0.6, "code": 0.4}
    base["actor_train"]["data_args"]["interleave_probs"] = "0.5,0.5"
    assert any("sampling the files by probability is not built" in r for r in from_roll(base).refused)
