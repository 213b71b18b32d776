"""NeMo RL's sliding-puzzle game (env.sliding_puzzle_game), its rules, and its example config scaled to
the bundled tiny model: it validates as written (but for its hub model) and runs."""

from __future__ import annotations

import random
from pathlib import Path


from novarl.config import load_config
from novarl.rollout.games.sliding_puzzle import SlidingPuzzle, apply, new_puzzle, render, solved_board

PUZZLE = Path(__file__).parent / "data" / "nemo_rl" / "2026-08" / "grpo_sliding_puzzle.yaml"


def one_move_from_solved() -> dict:
    board = solved_board(2)  # [[1, 2], [3, 0]]
    board[1][1], board[1][0] = 3, 0  # the empty square moved left: "left" (the tile right of it) solves it
    return {"size": 2, "grid": board, "empty": [1, 0]}


def turn(text: str) -> list[dict]:
    return [{"role": "user", "content": "puzzle"}, {"role": "assistant", "content": text}]


def test_the_moves_follow_nemo_rls_directions():
    state = one_move_from_solved()
    said, after = apply("left", state)
    assert after is not None and after["grid"] == solved_board(2) and "Tile 3" in said
    assert apply("right", state)[1] is None  # no tile left of the empty square
    assert apply("up", state)[1] is None  # none below it
    _, down = apply("down", state)  # the tile above (1) comes down
    assert down is not None and down["grid"] == [[0, 2], [1, 3]] and down["empty"] == [0, 0]
    assert apply("slide 2 2", state)[1]["grid"] == solved_board(2)  # the same move, by position
    assert apply("slide 1 2", state)[1] is None and apply("slide 9 9", state)[1] is None
    assert apply("jump", state)[1] is None


def test_an_episode_is_rewarded_once_solved_and_bounded_by_max_moves():
    game = SlidingPuzzle({"game_config": {"size": 2, "shuffle_moves": 1}, "max_moves": 2})
    first = {"game_state": one_move_from_solved(), "num_moves": 0, "max_moves": 2}
    assert game.step(turn("I think <action>left</action>"), first).reward == 1.0
    assert game.step(turn("<action>left</action>"), first).done
    missed = game.step(turn("no tags here"), first)
    assert (missed.reward, missed.done) == (0.0, False) and "<action>" in missed.observation["content"]
    assert missed.observation["role"] == "environment" and missed.metadata["num_moves"] == 0
    moved = game.step(turn("<action>view</action> then <action>down</action>"), first)  # the last tag counts
    assert not moved.done and moved.metadata["num_moves"] == 1
    assert moved.metadata["game_state"]["grid"] == [[0, 2], [1, 3]]
    spent = game.step(turn("<action>left</action>"), {**moved.metadata, "num_moves": 2})
    assert (spent.reward, spent.done) == (0.0, True)


def test_puzzles_are_shuffled_legally_and_made_per_split():
    state = new_puzzle(3, 7, random.Random(0))
    assert sorted(t for row in state["grid"] for t in row) == list(range(9))
    row, column = state["empty"]
    assert state["grid"][row][column] == 0 and "8" in render(state)
    game = SlidingPuzzle({"game_config": {"size": 3, "shuffle_moves": 5}, "max_moves": 4})
    train, again, held_out = game.examples("train", 20, 1), game.examples("train", 20, 1), game.examples("validation", 20, 1)
    assert [e.columns for e in train] == [e.columns for e in again]
    assert [e.columns for e in train] != [e.columns for e in held_out]
    assert all(e.columns["game_state"]["grid"] != solved_board(e.columns["game_state"]["size"]) for e in train)
    assert {e.columns["game_state"]["size"] for e in train} <= {2, 3} and train[0].columns["max_moves"] == 4


def test_nemo_rls_example_validates_and_its_game_runs_on_the_tiny_model(tmp_path):
    from novarl.logging.metrics import read_jsonl
    from novarl.trainer.api import GRPOTrainer

    cfg = load_config(PUZZLE)
    assert cfg.env["sliding_puzzle_game"].actor_class_fqn.endswith("sliding_puzzle:SlidingPuzzle")
    assert cfg.grpo.max_rollout_turns == 50
    small = load_config(PUZZLE, overrides=[
        "policy.model_name=tiny-arith", "policy.tokenizer.name=null", "policy.tokenizer.chat_template=null",
        "policy.generation.backend=hf",
        "policy.max_total_sequence_length=640", "policy.generation.max_new_tokens=8", "grpo.max_rollout_turns=3",
        "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=2", "grpo.max_num_steps=2",
        "grpo.max_val_samples=4", "grpo.val_period=0", "grpo.val_at_start=false", "policy.train_global_batch_size=8",
        "policy.train_micro_batch_size=8", "policy.logprob_batch_size=8", "policy.dtensor_cfg.cpu_offload=false",
        "env.sliding_puzzle_game.cfg.game_config.size=2", "env.sliding_puzzle_game.cfg.game_config.shuffle_moves=1",
        "checkpointing.enabled=false", "logger.monitor_gpus=false", "logger.progress_bar=false",
        "grpo.max_train_seconds=null", f"logger.log_dir={tmp_path}"])
    result = GRPOTrainer(small).train()
    steps = [r for r in read_jsonl(result.output_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert len(steps) == 2 and all(1.0 <= s["episode_turns_mean"] <= 3.0 for s in steps)
