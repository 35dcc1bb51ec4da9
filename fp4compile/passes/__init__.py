"""The backend's graph passes, one file per step (numbered as in :mod:`fp4compile.backend`): ``sites`` (1) and
``assign`` (2) on the Dynamo graph, ``attention`` (3, the attention swap), then ``linear`` (4), ``reuse`` (5)
and ``check`` (6) on the joint graph; ``common`` holds the FX helpers they share."""
