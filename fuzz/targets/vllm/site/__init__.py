"""Not imported as a package: the vLLM target puts this directory on the vLLM processes'
PYTHONPATH so that `sitecustomize.py` runs in each of them. The file exists so that the
directory ships with llmfuzz (setuptools' package discovery only finds packages)."""
