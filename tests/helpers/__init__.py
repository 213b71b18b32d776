HF = "policy.generation.backend=hf"
"""Runs whose subject is not generation pin Hugging Face generation: the bundled recipe
leaves the backend unset (vLLM where installed), and vLLM's engine start-up would add
seconds to each of them; tests/test_vllm.py covers vLLM."""
