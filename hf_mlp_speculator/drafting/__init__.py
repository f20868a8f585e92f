"""What drafts: the `Drafter` that both decoding loops use, chains and trees, prompt lookup, the controller that sizes
each step, its cost model and timings, and the state a verifier/speculator pair keeps between calls."""
