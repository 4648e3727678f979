"""What runs on the device-worker thread, step after step: the workspace (:mod:`.workspace`),
overlap resolution (:mod:`.overlap`), the draft stage and its proposers (:mod:`.draft`),
verify (:mod:`.verify`) and the sampler (:mod:`.sampler`, with :mod:`.logits_processing`,
:mod:`.rejection` and :mod:`.stops`). Only the device worker touches its state."""
