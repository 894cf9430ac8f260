"""The workbench: the command line, the report, the trainers, the pretrained-model registry and the
compression harness. The library (everything outside this folder) never imports it."""
