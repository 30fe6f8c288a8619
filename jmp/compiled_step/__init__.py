"""``@smp.step``: the user's step function traced into one compiled XLA program."""
