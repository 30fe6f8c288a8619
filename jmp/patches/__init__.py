"""Import paths of SMP's ``smdistributed.modelparallel.torch.patches``, for scripts that import from there."""
