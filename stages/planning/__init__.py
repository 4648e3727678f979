"""What runs on the Trio event loop to plan steps: the scheduler actor
(:mod:`.scheduler_actor`: ``SchedulerActor``, ``run_scheduler``), the scheduler's pure
logic (:mod:`.scheduler`: ``Scheduler``, ``Sequence``), the KV block manager
(:mod:`.block_manager`), the adaptive speculation policy (:mod:`.spec_policy`) and the
request lifecycle (:mod:`.lifecycle`). Nothing here touches the device."""
