// Load a Chrome trace-event file with Chrome DevTools' own trace model (@paulirish/trace_engine) and print
// what it understood, as JSON: {bounds, processes: [{pid, name, threads: [{tid, name, events: [...]}]}]}.
// Usage: node read_trace.mjs FILE. Written for ddpdoctor's tests; the model is DevTools', not ours.
import fs from 'node:fs';
import {polyfillDOMRect} from '@paulirish/trace_engine/analyze-trace.mjs';
import * as Trace from '@paulirish/trace_engine';

polyfillDOMRect();
const doc = JSON.parse(fs.readFileSync(process.argv[2], 'utf8'));
const model = Trace.TraceModel.Model.createWithAllHandlers();
await model.parse(doc.traceEvents ?? doc);
const parsed = model.parsedTrace();
const {Renderer: renderer, Meta: meta} = parsed.data ?? parsed;
const out = {bounds: meta.traceBounds, processes: []};
for (const [pid, process] of renderer.processes) {
  out.processes.push({
    pid,
    name: meta.processNames.get(pid)?.args?.name ?? null,
    threads: [...process.threads].map(([tid, thread]) => ({
      tid,
      name: thread.name,
      events: thread.entries.map(e => ({ph: e.ph, name: e.name, ts: e.ts, dur: e.dur ?? null})),
    })),
  });
}
console.log(JSON.stringify(out));
