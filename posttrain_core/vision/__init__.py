"""Vision-language support: images in datasets, and the tiny vision-language model and its inputs."""
