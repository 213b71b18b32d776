"""ROLL's algorithm keys in novarl's terms (config/roll.py reads the rest of the file): the
policy loss's clipping and KL, and the advantage estimator -- grpo and reinforce as novarl's
group-baseline estimators, gae (ROLL's default) as PPO's GAE -- and the keys ROLL reads only
when a switch is on."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from novarl.config.files import show_value
from novarl.config.roll_devices import Translation, _number


def algorithm(tree: Mapping[str, Any], out: Translation) -> None:
    """The estimator, the ratio clipping (pg_clip, its range, dual clipping), advantage_clip, the
    KL loss (use_kl_loss: k3, clamped as ROLL's) and loss_agg_mode onto grpo / loss_fn."""
    _estimator(tree, out)
    clip, low, high, advantage, kl = (_number(tree, k, out) for k in ("pg_clip", "pg_clip_low", "pg_clip_high",
                                                                     "advantage_clip", "kl_loss_coef"))
    if tree.get("use_pg_clip_range"):
        out.set("loss_fn.ratio_clip_min", low if low is not None else 0.2)
        out.set("loss_fn.ratio_clip_max", high if high is not None else 0.2)
    elif clip is not None:
        out.set("loss_fn.ratio_clip_min", clip)
        out.set("loss_fn.ratio_clip_max", clip)
    if tree.get("dual_clip_loss"):  # ROLL: loss = min(loss, -(1 + 2 pg_clip) A) where A < 0
        out.set("loss_fn.ratio_clip_c", 1 + 2 * (clip if clip is not None else 0.2))
    if advantage is not None:
        out.set("grpo.advantage_clip_low", -advantage)
        out.set("grpo.advantage_clip_high", advantage)
    if tree.get("use_kl_loss"):  # ROLL's KL loss: k3, clamped to [-10, 10]
        out.set("loss_fn.reference_policy_kl_penalty", kl or 0.0)
        out.set("loss_fn.kl_estimator", "k3")
        out.set("loss_fn.kl_output_clamp_value", 10.0)
    mode = tree.get("loss_agg_mode", "seq-mean-token-mean")
    if mode not in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        out.refuse("loss_agg_mode", mode, "novarl aggregates token-mean, seq-mean-token-mean, seq-mean-token-sum or "
                                          "seq-mean-token-sum-norm")
    else:
        out.set("loss_fn.loss_agg_mode", mode)


def _estimator(tree: Mapping[str, Any], out: Translation) -> None:
    """ROLL's advantage: rewards normalised by norm_mean_type / norm_std_type (grpo: both 'group'),
    the return (gamma 1: the reward on every token), then whitened over the step's tokens with
    whiten_advantages. In novarl's estimators: grpo is ROLL's grpo, and ROLL's reinforce with a
    group mean (or none) and whitening is reinforce_plus_plus (with or without minus_baseline);
    without whitening it is grpo with a group mean, normalised by the group's std or not."""
    estimator = estimator_of(tree)
    if estimator == "gae":
        _gae(tree, out)
        return
    if tree.get("gamma", 1) not in (1, 1.0) and estimator in ("grpo", "reinforce"):
        out.refuse("gamma", tree["gamma"], "novarl's group-baseline returns are undiscounted (gamma 1): the reward "
                                           "counts on every token of its completion; set gamma: 1, or adv_estimator: "
                                           "gae (PPO, discounted by gamma)")
    mean, std, whiten = tree.get("norm_mean_type"), tree.get("norm_std_type"), bool(tree.get("whiten_advantages"))
    if estimator == "grpo":
        mean, std = "group", "group"
    elif estimator != "reinforce":
        out.refuse("adv_estimator", estimator, "novarl reads ROLL's estimators grpo, reinforce and gae (PPO with a "
                                               "critic); pick one of them")
        return
    for key, value in (("norm_mean_type", mean), ("norm_std_type", std)):
        if value not in (None, "group"):
            out.refuse(key, value, "novarl normalises rewards within each GRPO group, or (REINFORCE++) whitens "
                                   "advantages over the step")
    if whiten and std is None:
        out.set("grpo.adv_estimator", {"name": "reinforce_plus_plus", "minus_baseline": mean == "group"})
    elif not whiten and mean == "group":
        out.set("grpo.adv_estimator", {"name": "grpo"})
        out.set("grpo.normalize_rewards", std == "group")
    elif estimator == "reinforce":
        out.refuse("adv_estimator", estimator, f"with norm_mean_type={mean!r}, norm_std_type={std!r} and "
                   f"whiten_advantages={whiten}: novarl's REINFORCE estimators subtract a group mean or whiten over "
                   "the step (reinforce_plus_plus)")
    elif whiten:
        out.refuse("whiten_advantages", True, "whitening GRPO's group-normalised advantages again is not built; set "
                                              "it false")


def estimator_of(tree: Mapping[str, Any]) -> Any:
    """ROLL's adv_estimator; gae (PPO with a critic) when the file does not name one, as in ROLL."""
    return tree.get("adv_estimator", "gae")


def _gae(tree: Mapping[str, Any], out: Translation) -> None:
    """ROLL's gae: each reward (clipped by reward_clip) on its completion's last token, GAE with
    gamma and lambd over the critic's values, whitened over the step's tokens with
    whiten_advantages, clipped by advantage_clip; the critic's loss clipped by value_clip (none
    when it is not given) and trained alone for critic_warmup steps. novarl's PPO is the same
    (grpo.adv_estimator gae, value_loss_fn, grpo.policy_training_start_step); the critic itself:
    _critic."""
    for key in ("norm_mean_type", "norm_std_type"):
        if tree.get(key) is not None:
            out.refuse(key, tree[key], "with adv_estimator gae novarl reads each reward as it is (ROLL normalises "
                                       "it first); set it null (whiten_advantages whitens the advantages)")
    lam, gamma = (_number(tree, key, out, positive=False) for key in ("lambd", "gamma"))
    out.set("grpo.adv_estimator", {"name": "gae", "gae_lambda": 0.95 if lam is None else lam,
                                   "gae_gamma": 1.0 if gamma is None else gamma,
                                   "normalize_advantages": bool(tree.get("whiten_advantages"))})
    clip = _number(tree, "value_clip", out)
    out.set("value_loss_fn.cliprange", clip)
    warmup = _number(tree, "critic_warmup", out, integer=True, positive=False)
    if warmup:
        out.set("grpo.policy_training_start_step", warmup)


READ_ONLY_WITH = (
    (("lambd", "value_clip", "critic_warmup"), lambda tree: estimator_of(tree) != "gae",
     "read with adv_estimator: gae (PPO with a critic), and this file's is {estimator}"),
    (("reward_pretrain",), lambda tree: estimator_of(tree) != "gae",
     "the model ROLL's reward workers and its critic load: novarl has no reward-model role (its math rule reward, "
     "reward.function, loads no model) and builds a critic on it only with adv_estimator: gae, and this file's is "
     "{estimator}"),
    (("init_kl_coef", "kl_penalty", "target_kl", "kl_horizon"), lambda tree: not tree.get("add_token_level_kl"),
     "ROLL's KL in the reward, which add_token_level_kl: false leaves off"),
    (("difficulty_low_threshold", "difficulty_high_threshold"), lambda tree: not tree.get("difficulty_mask"),
     "difficulty_mask's thresholds, and it is off"),
    (("enable_reference",), lambda tree: not tree.get("use_kl_loss"),
     "novarl loads a reference for the KL loss (use_kl_loss) only"),
)
"""ROLL keys read only when a switch is on: (keys, whether the switch is off, why)."""


def read_only_with(tree: Mapping[str, Any], out: Translation) -> None:
    """One warning for the keys READ_ONLY_WITH says are not used (given and not off), and for a
    num_nodes the device mappings contradict."""
    groups = []
    for keys, off, why in READ_ONLY_WITH:
        given = [k for k in keys if tree.get(k) not in (None, False, 0, 0.0)]
        if given and off(tree):
            groups.append(f"{', '.join(given)} ({why.format(estimator=show_value(estimator_of(tree)))})")
    nodes = out.tree.get("cluster", {}).get("num_nodes")
    if tree.get("num_nodes") is not None and nodes is not None and tree["num_nodes"] != nodes:
        groups.append(f"num_nodes={show_value(tree['num_nodes'])} (novarl counts the nodes from the device mappings, "
                      f"as ROLL does: {nodes})")
    if groups:
        out.warnings.append(f"ROLL settings accepted and not used: {'; '.join(groups)}")
