"""The pieces of ``python -m ragged_placement.train``: options (:mod:`.config`), what is trained
(:mod:`.build`), checkpoints (:mod:`.checkpoint`) and the process group (:mod:`.distributed`)."""
