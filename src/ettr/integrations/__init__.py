"""Integrations with training frameworks, each imported lazily where used (ettr's core needs none of them).

    from ettr.integrations.lightning import EttrCallback      # a Lightning Callback
    from ettr.integrations.huggingface import EttrCallback    # a Hugging Face TrainerCallback

Under `ettr run` the bootstrap adds the right one to every `Trainer` by itself; adding it explicitly as well
records nothing twice. See docs/lightning.md and docs/huggingface.md.
"""
