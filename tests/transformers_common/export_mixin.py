class ExportTesterMixin:
    pass
