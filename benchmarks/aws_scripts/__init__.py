"""What the benchmarks that run AWS's SMP example scripts bring to them: the checkout they are read from
(``checkout``), the CPU hosts that run them as SageMaker would (``smp_v1_host``, ``smp_v2_host``) and their
synthetic data (``make_data``). The scripts themselves are not in this repository."""
