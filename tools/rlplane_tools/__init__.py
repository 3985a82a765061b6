"""Tools beside the service, not inside its runtime: ``rlplane demo`` and ``rlplane bench``.

- :mod:`rlplane_tools.demo`: one VLM GRPO step through a live service, verified bit for bit
- :mod:`rlplane_tools.demo_async`: asynchronous GRPO through streaming claims, exactly-once checked
- :mod:`rlplane_tools.bench`: every data path and the peers, side by side
- :mod:`rlplane_tools.timing`: phase tables (MB, ms, GB/s) and the memcpy bound

The PNG chart needs the ``bench`` extra (matplotlib); the production image does not
install it.
"""
