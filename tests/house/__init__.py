"""The house: the package's layering, the tests' own layout, the wheel, installs, the shipped demo model."""
