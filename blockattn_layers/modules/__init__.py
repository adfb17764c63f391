"""nn.Module layers built on block attention."""
