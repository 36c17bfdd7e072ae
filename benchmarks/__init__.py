"""The measurements behind the README's figures: each a module run as ``python -m benchmarks.<name>`` from the
repository's root, reading the same YAML configs as ``moco-lightning fit`` and using only the library's public API
(``benchmarks/README.md`` lists them with their commands and results). Not installed with the library."""
