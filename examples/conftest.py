"""The plugin's own hooks, implemented for this example suite."""


def pytest_smolvm_configure_vm(item, spec):
    # Runs before each guest is made; `spec` holds the resolved `smol` marker keywords.
    spec["env"] = {"SUITE": "examples", **spec["env"]}
