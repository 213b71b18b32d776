"""The advisor's candidates as `novarl plan` prints them (novarl/plan/advisor.py advises)."""

from __future__ import annotations

from novarl.plan.advisor import HEADROOM, Advice

_TABLE_COLUMNS = (("params", "params"), ("grads", "grads"), ("optimizer", "optim"), ("gathered_params", "gathered"),
                  ("activations", "activ"), ("reference_weights", "ref wts"), ("critic_states", "critic"),
                  ("generator_weights", "gen wts"), ("kv_cache", "KV"), ("peak", "peak"))


def format_advice(advice: Advice) -> str:
    """The advice as `novarl plan` prints it: one row per candidate, GB per GPU, then
    the recommendation and the explanation."""
    header = (f"{'strategy':<34} {'dp':>3} {'tp':>2} {'pp':>2} {'ep':>2} {'generation':<14} {'placement':<9} "
              + " ".join(f"{label:>9}" for _, label in _TABLE_COLUMNS) + f" {'fits':<4} {'score':>5}")
    rows = [f"layouts, GB per GPU (fits: peak <= {HEADROOM:.0%} of {advice.gpu_memory_gb:g} GB):", header]
    for c in advice.candidates:
        name = (c.strategy + (f" +vpp{c.virtual_pipeline_parallel_size}" if c.virtual_pipeline_parallel_size > 1 else "")
                + (" +ckpt" if c.activation_checkpointing else "") + ("" if c.built else " *"))
        numbers = " ".join(f"{c.memory_gb[key]:>9.{1 if c.memory_gb[key] >= 10 else 3}f}" for key, _ in _TABLE_COLUMNS)
        rows.append(f"{name:<34} {c.data_parallel_size:>3} {c.tensor_parallel_size:>2} {c.pipeline_parallel_size:>2} "
                    f"{c.expert_parallel_size:>2} "
                    f"{c.generation_backend + ' tp=' + str(c.generation_tp):<14} {c.placement:<9} {numbers} "
                    f"{'yes' if c.fits else 'no':<4} {c.score:>5.2f}")
    rows.append("+vpp2: interleaved pipeline, 2 model chunks per stage; +ckpt: with full activation checkpointing "
                "(tried when a layout does not fit without it); *: a backend novarl does not have yet; "
                "peak: see novarl.plan.advisor")
    rows.append(f"recommended: {advice.recommended.describe() if advice.recommended else 'none (nothing fits)'}")
    rows += [f"- {line}" for line in advice.explanation]
    return "\n".join(rows)
