"""Engine benchmarks through its Python API, no server: throughput (CPU, GPU, adapters), what each feature costs."""
