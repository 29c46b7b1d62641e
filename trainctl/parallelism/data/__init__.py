"""Training data: corpora and token shards in one seeded sample order, tokenizers, the prefetching loader."""
