"""The deployable stacks: one `CellStack` per cell, one `PipelineStack` per fleet."""
