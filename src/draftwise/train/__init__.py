"""Training pipeline for the embedded default model pair: corpus, tokenizer, target, distilled draft.

`draftwise train tokenizer|target|draft|all` (see `draftwise.cli.train`) drives these modules.
"""
