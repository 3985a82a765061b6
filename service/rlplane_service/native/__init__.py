"""rlplane's own storage engine (backend ``native``): a controller actor that holds the
sample index as arrays, storage-unit actors that hold columnar blocks, and the server
loop both run (see :mod:`.server`, :mod:`.controller`, :mod:`.unit`)."""
