"""Test fixtures that ship with rlplane: the reference workloads and a bit-exact comparison.

- :mod:`rlplane.testing.workloads`: vlm-step, text-step, small, text-scale batches
  (what the demo, the bench and the tests move).
- :mod:`rlplane.testing.verify`: ``diff_fields``, every difference between what was
  written and what was read, naming field and sample.

Example::

    from rlplane.testing.workloads import vlm_step
    from rlplane.testing.verify import diff_fields
"""
