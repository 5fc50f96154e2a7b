"""The canary: a synthetic long-reasoning task (`task`), a small Qwen3 trained on it here (`train`, its
tokenizer in `vocabulary`, the weights in `model/`), so that accuracy under KV compression can be
measured offline, on a CPU, with a model that actually answers."""
