"""metasd: lossless speculative decoding with a pool of drafters and a bandit policy."""
