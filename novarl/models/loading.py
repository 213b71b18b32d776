"""Loading Hugging Face checkpoints: a bundled name, a local folder, or a hub id.

Safe by default: safetensors weights only, and `trust_remote_code` only when
the config sets it. Every failure is a `UserError` naming the model.
"""

from __future__ import annotations

from pathlib import Path

import torch

from novarl.errors import UserError
from novarl.models.bundled import resolve_bundled

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_model_path(name_or_path: str) -> str:
    """The folder or hub id to load: bundled names first, then local paths.

    Only an `org/name` that is not a local folder is passed on as a hub id;
    anything else that is not a model folder is an error naming it.
    """
    bundled = resolve_bundled(name_or_path)
    if bundled is not None:
        return str(bundled)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError(f"policy.model_name='{name_or_path}': the folder has no config.json; "
                            "give a Hugging Face model folder (config.json + *.safetensors).")
        return str(path)
    hub_id = name_or_path.count("/") == 1 and not name_or_path.startswith((".", "/", "~"))
    if not hub_id or path.exists():
        raise UserError(f"policy.model_name='{name_or_path}': no model folder there. Give a local "
                        "Hugging Face folder, a hub id (org/name), or a bundled model (tiny-arith).")
    return name_or_path


def load_tokenizer(name_or_path: str, *, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    source = resolve_model_path(name_or_path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        raise UserError(f"Cannot load the tokenizer of '{name_or_path}': {_first_line(err)}") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_causal_lm(name_or_path: str, *, dtype: torch.dtype = torch.float32,
                   trust_remote_code: bool = False) -> torch.nn.Module:
    """A causal LM in `dtype` on the CPU, in train mode off (eval)."""
    from transformers import AutoModelForCausalLM

    source = resolve_model_path(name_or_path)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            source, dtype=dtype, use_safetensors=True, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        raise UserError(f"Cannot load model '{name_or_path}': {_first_line(err)} "
                        "(novarl loads safetensors weights only, and remote code only with "
                        "policy.trust_remote_code=true).") from None
    model.eval()
    return model


def _first_line(err: Exception) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """[B, L] log p(input_ids[:, t] | input_ids[:, :t]) from logits [B, L, V]; position 0 is 0.

    Logits are divided by the sampling temperature so that the ratio the loss
    uses is between the same distributions the generator sampled from.
    """
    logits = logits[:, :-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    picked = torch.gather(logits, -1, input_ids[:, 1:, None]).squeeze(-1)
    logprobs = picked - torch.logsumexp(logits, dim=-1)
    return torch.nn.functional.pad(logprobs, (1, 0))


def save_hf_folder(path, model_config, state: dict, tokenizer) -> None:
    """Write full weights `state` (Hugging Face names) as a Hugging Face folder, fp32
    safetensors, with the tokenizer: what transformers and vLLM load as is."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(model_config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict({k: v.float() for k, v in state.items()}, strict=False, assign=True)
    plain.tie_weights()  # a tied copy (lm_head.weight) may be absent: it is the embedding
    tied = plain._tied_weights_keys or ()
    if unexpected or any(key not in tied for key in missing):
        raise RuntimeError(f"weights do not match {type(plain).__name__}: missing {missing}, unexpected {unexpected}")
    plain.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
