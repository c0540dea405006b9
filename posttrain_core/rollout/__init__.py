"""Generation engines: Hugging Face generate on CPU (tests, evaluation) and vLLM on GPU."""
