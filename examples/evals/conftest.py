"""Hooks for the eval suite."""


def pytest_smolvm_collect_artifacts(item, vm):
    # Saved under --smol-artifacts=DIR/<test id>/files/ when an episode fails (or with
    # --smol-logs=always): the agent's answer, copied out before the guest is destroyed.
    return ["/workspace"]
