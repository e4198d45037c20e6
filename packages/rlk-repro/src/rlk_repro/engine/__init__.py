"""The local engine: a paged-KV continuous-batching rollout engine and a packed-sequence GRPO trainer."""
