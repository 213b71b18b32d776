"""NeMo RL's sliding-puzzle game (`env.sliding_puzzle_game`, its example grpo_sliding_puzzle.yaml),
written from its rules: a size x size board of tiles 1..size^2-1 and one empty square (0), shuffled
by random legal moves from the solved board (the empty square at the bottom right). Each turn the
model names one action in `<action>...</action>` (the last such tag of its turn counts):
- `up` / `down` / `left` / `right`: the tile below / above / right of / left of the empty square
  slides into it;
- `slide R C`: the tile at row R, column C (from 1) slides into the empty square next to it;
- `view`: the board again, no move.
A move that solves the board ends the episode with reward 1; every other turn earns 0 (an invalid
action costs nothing but the turn), and the episode ends without reward once `max_moves` moves were
made. The environment answers as role "environment", its text in `<environment>...</environment>`.

cfg (NeMo RL's keys): `game_config: {size, shuffle_moves}` bound the generated puzzles (each takes a
size from 2 to `size` and an odd number of shuffling moves from 1 to `shuffle_moves`, as NeMo RL's
example draws them), `max_moves` the moves an episode may make. The game makes its own prompts
(`examples`): the data section is not read.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping
from typing import Any

from novarl.data.arithmetic import Example
from novarl.rollout.environment import EnvStep

DIRECTIONS = {"up": (1, 0), "down": (-1, 0), "left": (0, 1), "right": (0, -1)}
"""An action -> where the moving tile is, from the empty square (row, column offsets)."""
ACTION = re.compile(r"<action>(.*?)</action>", re.IGNORECASE | re.DOTALL)
STOP_STRINGS = ("</action>",)
"""What ends a turn (NeMo RL's puzzle data asks the engines to stop there)."""


def solved_board(size: int) -> list[list[int]]:
    board = [[row * size + column + 1 for column in range(size)] for row in range(size)]
    board[-1][-1] = 0
    return board


def new_puzzle(size: int, shuffle_moves: int, rng: random.Random) -> dict[str, Any]:
    """A board shuffled by `shuffle_moves` random legal moves of the empty square from the solved one."""
    board = solved_board(size)
    empty = (size - 1, size - 1)
    for _ in range(shuffle_moves):
        row, column = empty
        options = [(row + dr, column + dc) for dr, dc in ((0, 1), (1, 0), (0, -1), (-1, 0))
                   if 0 <= row + dr < size and 0 <= column + dc < size]
        target = rng.choice(options)
        board[row][column], board[target[0]][target[1]] = board[target[0]][target[1]], 0
        empty = target
    return {"size": size, "grid": board, "empty": list(empty)}


def render(state: Mapping[str, Any]) -> str:
    """The board with row and column numbers, the empty square blank."""
    size, grid = state["size"], state["grid"]
    width = len(str(size * size - 1))
    lines = ["    " + " ".join(f"{column + 1:>{width}}" for column in range(size))]
    for row, tiles in enumerate(grid):
        cells = " ".join(f"{tile:>{width}}" if tile else " " * width for tile in tiles)
        lines.append(f"{row + 1:>2} |{cells}|")
    return "\n".join(lines)


def apply(action: str, state: Mapping[str, Any]) -> tuple[str, dict[str, Any] | None]:
    """(what happened, the board after the move) -- None for the board when no move was made."""
    size, grid = state["size"], state["grid"]
    empty_row, empty_column = state["empty"]
    action = " ".join(action.lower().split())
    if action in DIRECTIONS:
        dr, dc = DIRECTIONS[action]
        row, column = empty_row + dr, empty_column + dc
        if not (0 <= row < size and 0 <= column < size):
            return f"No tile can slide {action}.", None
    elif action.startswith("slide "):
        parts = action.split()
        if len(parts) != 3 or not all(p.isdigit() for p in parts[1:]):
            return "Write a slide as: slide ROW COLUMN.", None
        row, column = int(parts[1]) - 1, int(parts[2]) - 1
        if not (0 <= row < size and 0 <= column < size):
            return f"Rows and columns go from 1 to {size}.", None
        if abs(row - empty_row) + abs(column - empty_column) != 1:
            return "Only a tile next to the empty square can slide.", None
    else:
        return f"Unknown action {action!r}: up, down, left, right, slide ROW COLUMN or view.", None
    tile = grid[row][column]
    board = [list(line) for line in grid]
    board[empty_row][empty_column], board[row][column] = tile, 0
    return f"Tile {tile} slid into the empty square.", {"size": size, "grid": board, "empty": [row, column]}


class SlidingPuzzle:
    """The game as an environment (novarl/rollout/environment.py) that also makes its puzzles."""

    stop_strings = STOP_STRINGS

    def __init__(self, cfg: Mapping[str, Any]) -> None:
        game = dict(cfg.get("game_config") or {})
        self.size = int(game.get("size", 3))
        self.shuffle_moves = int(game.get("shuffle_moves", 10))
        self.max_moves = int(cfg.get("max_moves", 50))
        if self.size < 2 or self.shuffle_moves < 1 or self.max_moves < 1:
            raise ValueError(f"game_config.size >= 2, game_config.shuffle_moves >= 1 and max_moves >= 1 "
                             f"(given {self.size}, {self.shuffle_moves}, {self.max_moves})")

    def examples(self, split: str, count: int, seed: int) -> list[Example]:
        """`count` puzzles of `split` (each split its own random stream), each a prompt of the rules
        and the board, its state in the row's fields (the episode's first metadata)."""
        rng = random.Random(f"sliding_puzzle:{split}:{seed}")
        out = []
        for _ in range(count):
            size = rng.randint(2, self.size)
            moves = rng.randint(1, self.shuffle_moves) | 1  # odd: never the solved board
            state = new_puzzle(size, moves, rng)
            out.append(Example(prompt=({"role": "user", "content": instructions(state)},), answer="",
                               columns={"game_state": state, "num_moves": 0, "max_moves": self.max_moves}))
        return out

    def step(self, conversation, metadata: Mapping[str, Any]) -> EnvStep:
        state, moves = metadata["game_state"], int(metadata.get("num_moves", 0))
        if moves >= self.max_moves:
            return EnvStep(reward=0.0, done=True)
        actions = ACTION.findall(conversation[-1]["content"])
        if not actions:
            return self._answer(f"{render(state)}\n\nNo move made: name one action as <action>ACTION</action>.",
                                metadata)
        action = actions[-1].strip()
        if action.lower() == "view":
            return self._answer(render(state), metadata)
        said, after = apply(action, state)
        if after is None:
            return self._answer(said, metadata)
        if after["grid"] == solved_board(after["size"]):
            return EnvStep(reward=1.0, done=True)
        return self._answer(said, {**metadata, "game_state": after, "num_moves": moves + 1})

    @staticmethod
    def _answer(text: str, metadata: Mapping[str, Any]) -> EnvStep:
        return EnvStep(reward=0.0, done=False, metadata=dict(metadata),
                       observation={"role": "environment", "content": f"<environment>\n{text}\n</environment>\n"})


def instructions(state: Mapping[str, Any]) -> str:
    size = state["size"]
    return (f"Sliding puzzle, {size}x{size}. Put the tiles in order, 1 to {size * size - 1} row by row, with the "
            f"empty square at the bottom right.\n\n{render(state)}\n\n"
            "Each turn, give one action as <action>ACTION</action>: up, down, left or right (the tile below, "
            "above, right of or left of the empty square slides into it), slide ROW COLUMN (the tile there "
            "slides into the empty square next to it), or view (the board again).\n")
