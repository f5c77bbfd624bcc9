"""The chaos cells `make test` runs (the whole matrix is `make chaos`): a node lost while a
checkpoint uploads (the partial checkpoint must never be loaded), a Spot notice (nothing trained
may be lost), a frozen instance (no EC2 event: the hang timeout and the liveness look must find
it), a hung trainer rank. See localcloud.chaos for what each cell must show."""

from chaos_cells import cell_tests

outcomes, test_the_cell_holds_every_promise = cell_tests(
    ["kill@checkpoint-write", "spot@training", "freeze@training", "hang@training"])
