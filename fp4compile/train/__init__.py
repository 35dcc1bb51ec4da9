"""Training: the ``fp4compile`` command line (:mod:`.cli`), tokenizers and batches (:mod:`.data`), the GPT
model (:mod:`.model`), the training loop (:mod:`.loop`) and DDP/FSDP2 (:mod:`.distributed`)."""
