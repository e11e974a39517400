def print_layouts(config, preset):
    raise NotImplementedError
