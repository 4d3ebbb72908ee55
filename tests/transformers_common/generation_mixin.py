class GenerationTesterMixin:
    pass
