"""The run itself: config, SageMaker's intake, the mesh and ranks, the compilation cache, host comms."""
