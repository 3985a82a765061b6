"""Adapters between rlplane's verbs and the batch types frameworks hand around
(each behind its own extra; importing this package imports none of them)."""
