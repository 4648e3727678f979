"""spectrio.tools.training: training the models spectrio serves.

* :mod:`.train`: ``spectrio train``, the bundled Llama target and its MTP layer, in two
  phases; :mod:`.chain` unrolls the MTP layer as the runtime drafts, :mod:`.optim` holds
  the learning-rate schedule and optimizer both trainings use;
* :mod:`.train_mtp`: ``spectrio train-mtp``, an MTP head for a model that ships none, in
  three resumable stages (:mod:`.mtp_generations`, :mod:`.mtp_features`,
  :mod:`.mtp_loop`);
* the data: :mod:`.corpus` (the standard library's sources, with a held-out split),
  :mod:`.tokenizer_train` (the bundled BPE), :mod:`.chat_prompts` (user messages to
  train on, and held-out ones ``bench`` measures with).

Submodules are imported explicitly; this package exports no names of its own.
"""
