// The Chorus playground: speaks through the gateway's own HTTP API, playing a WAV as it streams and a
// compressed format (mp3, opus, flac, aac) once it is whole, then offers the file for download.
// window.chorusPlayground.lastRun tells tests (and the curious) what the last Speak got.
"use strict";

const $ = (id) => document.getElementById(id);
const page = (window.chorusPlayground = { ready: false, lastRun: null });
const state = { models: [], voices: [], clip: null, voiceClip: null, run: null, audio: null, fileUrl: null };

// ---- talking to the gateway ---------------------------------------------------------------------

async function api(path, options) {
  const resp = await fetch(path, options);
  if (!resp.ok) {
    let message = `${resp.status} ${resp.statusText}`;
    try { message = `${resp.status}: ${(await resp.json()).error.message}`; } catch (_) { /* not JSON */ }
    throw new Error(message);
  }
  return resp;
}

const chosenModel = () => state.models.find((m) => m.id === $("model").value) || state.models[0];

function option(select, value, label) {
  const o = document.createElement("option");
  o.value = value;
  o.textContent = label;
  select.append(o);
}

async function loadModels() {
  state.models = (await (await api("/v1/models")).json()).data;
  for (const select of [$("model"), $("voice-model")]) select.replaceChildren();
  option($("voice-model"), "", "default model");
  for (const m of state.models) {
    option($("model"), m.id, `${m.id} (${m.architecture})`);
    option($("voice-model"), m.id, m.id);
  }
  const preferred = state.models.find((m) => m.default);
  if (preferred) $("model").value = preferred.id;
  showKnobs();
}

function showKnobs() {
  // speed and the unmasking knobs mean something only to OmniVoice; MOSS refuses a speed other than 1
  const omni = chosenModel()?.architecture === "omnivoice";
  $("omnivoice-knobs").hidden = !omni;
  $("speed").disabled = !omni;
}

async function loadVoices() {
  state.voices = (await (await api("/v1/audio/voices")).json()).data;
  $("voice-list").replaceChildren(...state.voices.map(voiceRow));
  listVoices();
}

// The voice menu: the stored voices the chosen model can speak with (a voice serves the model that encoded it).
function listVoices() {
  const picked = $("voice").value, model = chosenModel()?.id;
  $("voice").replaceChildren();
  option($("voice"), "", "the model's own voice");
  for (const v of state.voices) if (!v.model || v.model === model) option($("voice"), v.id, v.id);
  if (state.clip) option($("voice"), "@clip", `the clip (${state.clip.name})`);
  if ([...$("voice").options].some((o) => o.value === picked)) $("voice").value = picked;
}

function voiceRow(v) {
  const row = document.createElement("tr");
  for (const text of [v.id, v.model || "default", v.frames, v.transcript]) {
    const cell = row.insertCell();
    cell.textContent = text;
  }
  const remove = document.createElement("button");
  remove.textContent = "Delete";
  remove.className = "delete";
  remove.onclick = () => guard($("voice-status"), async () => {
    await api(`/v1/audio/voices/${encodeURIComponent(v.id)}`, { method: "DELETE" });
    $("voice-status").textContent = `deleted ${v.id}`;
    await loadVoices();
  });
  row.insertCell().append(remove);
  return row;
}

async function guard(errorLine, work) {
  errorLine.classList.remove("error");
  try {
    await work();
  } catch (e) {
    errorLine.textContent = e.message;
    errorLine.classList.add("error");
    return e;
  }
}

// ---- reference clips: a file or the microphone, sent as 16-bit WAV --------------------------------

function audioContext() {
  state.audio = state.audio || new AudioContext();
  return state.audio;
}

// Any audio the browser can decode (a recording's WebM too) as a WAV file, which the server reads.
async function toWav(blob) {
  const audio = await audioContext().decodeAudioData(await blob.arrayBuffer());
  const channels = audio.numberOfChannels, n = audio.length, bytes = n * channels * 2;
  const view = new DataView(new ArrayBuffer(44 + bytes));
  const text = (at, s) => [...s].forEach((c, i) => view.setUint8(at + i, c.charCodeAt(0)));
  text(0, "RIFF"); view.setUint32(4, 36 + bytes, true); text(8, "WAVEfmt ");
  view.setUint32(16, 16, true); view.setUint16(20, 1, true); view.setUint16(22, channels, true);
  view.setUint32(24, audio.sampleRate, true); view.setUint32(28, audio.sampleRate * channels * 2, true);
  view.setUint16(32, channels * 2, true); view.setUint16(34, 16, true); text(36, "data");
  view.setUint32(40, bytes, true);
  const data = [...Array(channels).keys()].map((c) => audio.getChannelData(c));
  for (let i = 0, at = 44; i < n; i++) {
    for (let c = 0; c < channels; c++, at += 2) {
      view.setInt16(at, Math.max(-1, Math.min(1, data[c][i])) * 32767, true);
    }
  }
  return new Blob([view], { type: "audio/wav" });
}

async function asClip(blob, name) {
  try {
    return { wav: await toWav(blob), name };
  } catch (_) {
    return { wav: blob, name };  // the browser cannot decode it: let the server try
  }
}

// The record button toggles recording; onClip gets the recording once it stops.
function recorder(button, errorLine, onClip) {
  let rec = null;
  button.onclick = () => guard(errorLine, async () => {
    if (rec) return rec.stop();
    const stream = await navigator.mediaDevices.getUserMedia({ audio: true });
    const parts = [];
    rec = new MediaRecorder(stream);
    rec.ondataavailable = (e) => parts.push(e.data);
    rec.onstop = async () => {
      stream.getTracks().forEach((t) => t.stop());
      button.textContent = "Record";
      onClip(await asClip(new Blob(parts, { type: rec.mimeType }), "recording"));
      rec = null;
    };
    rec.start();
    button.textContent = "Stop recording";
  });
}

async function setClip(clip) {
  state.clip = clip;
  $("clip-status").textContent = `${clip.name}: ${(clip.wav.size / 1024).toFixed(0)} KiB`;
  listVoices();
  $("voice").value = "@clip";
}

const base64 = (blob) => new Promise((resolve) => {
  const reader = new FileReader();
  reader.onload = () => resolve(reader.result.slice(reader.result.indexOf(",") + 1));
  reader.readAsDataURL(blob);
});

// ---- playing PCM as it arrives --------------------------------------------------------------------

// Schedules interleaved PCM16 chunks back to back on the Web Audio clock.
class Player {
  constructor(ctx, rate, channels) {
    Object.assign(this, { ctx, rate, channels, next: 0, rest: new Uint8Array(0), sources: new Set() });
    this.allPlayed = new Promise((resolve) => (this.played = resolve));
  }

  // The chunk's first channel as floats (for the waveform); bytes of a partial frame wait for the next.
  push(bytes) {
    const all = new Uint8Array(this.rest.length + bytes.length);
    all.set(this.rest);
    all.set(bytes, this.rest.length);
    const frameBytes = 2 * this.channels, n = Math.floor(all.length / frameBytes);
    this.rest = all.slice(n * frameBytes);
    if (n === 0) return new Float32Array(0);
    const pcm = new Int16Array(all.buffer, 0, n * this.channels);
    const buffer = this.ctx.createBuffer(this.channels, n, this.rate);
    for (let c = 0; c < this.channels; c++) {
      const out = buffer.getChannelData(c);
      for (let i = 0; i < n; i++) out[i] = pcm[i * this.channels + c] / 32768;
    }
    const source = this.ctx.createBufferSource();
    source.buffer = buffer;
    source.connect(this.ctx.destination);
    const at = Math.max(this.next, this.ctx.currentTime + 0.05);  // a late chunk starts a little ahead
    source.start(at);
    this.began = this.began ?? at;
    this.next = at + n / this.rate;
    this.sources.add(source);
    source.onended = () => {
      this.sources.delete(source);
      if (this.finished && this.sources.size === 0) this.played();
    };
    return buffer.getChannelData(0);
  }

  finish() {
    this.finished = true;
    if (this.sources.size === 0) this.played();
  }

  stop() {
    for (const s of this.sources) s.stop();
  }
}

// Peaks of the audio so far, drawn as bars, with a line where playback is.
class Wave {
  constructor(canvas, rate, expectedSeconds) {
    Object.assign(this, { canvas, block: Math.round(rate / 100), peaks: [], expected: expectedSeconds * 100 });
  }

  add(samples) {
    for (let i = 0; i < samples.length; i += this.block) {
      let peak = 0;
      for (let j = i; j < Math.min(i + this.block, samples.length); j++) peak = Math.max(peak, Math.abs(samples[j]));
      this.peaks.push(peak);
    }
  }

  draw(playedSeconds) {
    const g = this.canvas.getContext("2d"), { width, height } = this.canvas;
    const scale = width / Math.max(this.peaks.length, this.expected, 1);
    g.clearRect(0, 0, width, height);
    g.fillStyle = "#4f7cac";
    this.peaks.forEach((p, i) => g.fillRect(i * scale, (height - p * height) / 2, Math.max(scale, 1), p * height || 1));
    g.fillStyle = "#d9534f";
    g.fillRect(Math.min(playedSeconds * 100 * scale, width - 2), 0, 2, height);
  }
}

// ---- Speak ----------------------------------------------------------------------------------------

async function speechBody() {
  const model = chosenModel();
  const body = { model: model.id, input: $("text").value, response_format: $("format").value, stream_format: "audio" };
  if ($("seed").value !== "") body.seed = Number($("seed").value);
  if ($("instructions").value) body.instructions = $("instructions").value;
  const frames = (id) => Math.max(1, Math.round(Number($(id).value) * model.frame_rate));
  if (Number($("min-seconds").value) > 0) body.min_frames = frames("min-seconds");
  if (Number($("max-seconds").value) > 0) body.max_frames = frames("max-seconds");
  if (model.architecture === "omnivoice") {
    body.speed = Number($("speed").value);
    body.omnivoice = { num_step: Number($("num-step").value), guidance_scale: Number($("guidance-scale").value) };
  }
  const voice = $("voice").value;
  if (voice === "@clip") {
    body.reference_audio = await base64(state.clip.wav);
    if ($("clip-text").value) body.reference_text = $("clip-text").value;
  } else if (voice) {
    body.voice = voice;
  }
  return body;
}

// The PCM bytes of a streamed WAV: the chunks before the "data" chunk's start are header.
function wavBody() {
  let head = new Uint8Array(0), found = false;
  return (bytes) => {
    if (found) return bytes;
    const all = new Uint8Array(head.length + bytes.length);
    all.set(head);
    all.set(bytes, head.length);
    for (let i = 12; i + 8 <= all.length; i++) {
      if (String.fromCharCode(...all.subarray(i, i + 4)) === "data") {
        found = true;
        return all.subarray(i + 8);
      }
    }
    head = all;
    return new Uint8Array(0);
  };
}

// The streamed WAV as a file: its RIFF and data sizes, unknown while it streamed, filled in.
function sizedWav(parts) {
  const all = new Uint8Array(parts.reduce((n, p) => n + p.length, 0));
  let at = 0;
  for (const p of parts) {
    all.set(p, at);
    at += p.length;
  }
  const view = new DataView(all.buffer);
  view.setUint32(4, all.length - 8, true);
  for (let i = 12; i + 8 <= all.length; i += 8 + view.getUint32(i + 4, true)) {
    if (String.fromCharCode(...all.subarray(i, i + 4)) === "data") {
      view.setUint32(i + 4, all.length - i - 8, true);
      break;
    }
  }
  return all;
}

// The finished file (returned) in the page's player and behind the download link, named by its format.
function offerFile(parts, format, type) {
  const file = new Blob(format === "wav" ? [sizedWav(parts)] : parts, { type });
  if (state.fileUrl) URL.revokeObjectURL(state.fileUrl);
  state.fileUrl = URL.createObjectURL(file);
  $("audio").src = state.fileUrl;
  $("download").href = state.fileUrl;
  $("download").download = `chorus-speech.${format}`;
  $("result").hidden = false;
  return file;
}

// Plays the page's player to its end; rejects when Stop aborts the run.
function playToEnd(signal) {
  const audio = $("audio");
  return new Promise((resolve, reject) => {
    if (signal.aborted) return reject(new DOMException("stopped", "AbortError"));
    audio.onended = resolve;
    audio.onerror = () => reject(new Error(`the browser cannot play this file (${audio.error?.message || "error"})`));
    signal.addEventListener("abort", () => reject(new DOMException("stopped", "AbortError")));
    audio.play().catch(reject);
  });
}

function showStats(run) {
  const parts = [];
  if (run.ttfaMs) parts.push(`first ${run.format === "wav" ? "audio" : "bytes"} ${run.ttfaMs.toFixed(0)} ms`);
  if (run.audioSeconds) parts.push(`${run.audioSeconds.toFixed(2)} s of audio in ${(run.totalMs / 1000).toFixed(2)} s`);
  else if (run.bytes) parts.push(`${(run.bytes / 1024).toFixed(0)} KiB in ${(run.totalMs / 1000).toFixed(2)} s`);
  if (run.done && run.rtf) parts.push(`real-time factor ${run.rtf.toFixed(2)}`);
  $("stats").textContent = parts.join(" · ");
}

async function speak() {
  stopSpeaking();
  const ctx = audioContext();
  await ctx.resume();  // a click lets the page make sound
  const format = $("format").value, streamed = format === "wav";
  const run = (page.lastRun = { format, contentType: "", bytes: 0, ttfaMs: 0, samples: 0, sampleRate: 0,
                                channels: 0, audioSeconds: 0, totalMs: 0, rtf: 0, playedMs: 0, duration: 0,
                                download: "", done: false, played: false, error: null });
  const abort = new AbortController();
  state.run = { abort, player: null, run };
  $("speak-button").disabled = true;
  $("stop-button").disabled = false;
  $("speak-error").textContent = "";
  $("result").hidden = true;
  try {
    const body = JSON.stringify(await speechBody());
    const start = performance.now();
    const resp = await api("/v1/audio/speech", {
      method: "POST", headers: { "Content-Type": "application/json" }, body, signal: abort.signal });
    run.contentType = resp.headers.get("Content-Type");
    run.sampleRate = Number(resp.headers.get("X-Sample-Rate"));
    run.channels = Number(resp.headers.get("X-Channels"));
    const player = (state.run.player = streamed ? new Player(ctx, run.sampleRate, run.channels) : null);
    let wave = new Wave($("wave"), run.sampleRate, Number($("max-seconds").value) || 1);
    const playedSeconds = () => (streamed ? ctx.currentTime - (player.began ?? Infinity) : $("audio").currentTime);
    const animate = () => {
      wave.draw(Math.max(0, playedSeconds()));
      if (!run.played && !run.error) requestAnimationFrame(animate);
    };
    requestAnimationFrame(animate);
    const pcm = wavBody(), parts = [];
    const reader = resp.body.getReader();
    for (let r = await reader.read(); !r.done; r = await reader.read()) {
      parts.push(r.value);
      run.bytes += r.value.length;
      run.totalMs = performance.now() - start;
      if (streamed) {  // a WAV plays as it arrives; a compressed file once whole
        const samples = player.push(pcm(r.value));
        if (samples.length === 0) continue;
        run.samples += samples.length;
        wave.add(samples);
        run.audioSeconds = run.samples / run.sampleRate;
      }
      run.ttfaMs = run.ttfaMs || performance.now() - start;
      showStats(run);
    }
    run.totalMs = performance.now() - start;
    const file = offerFile(parts, format, run.contentType);
    run.download = $("download").download;
    if (!streamed) {  // its waveform and length from the browser's decoder
      const decoded = await ctx.decodeAudioData(await file.arrayBuffer());
      wave = new Wave($("wave"), decoded.sampleRate, decoded.duration);
      wave.add(decoded.getChannelData(0));
      run.audioSeconds = decoded.duration;
      run.samples = Math.round(decoded.duration * run.sampleRate);
    }
    run.rtf = run.audioSeconds ? run.totalMs / 1000 / run.audioSeconds : 0;
    run.done = true;
    showStats(run);
    if (streamed) {
      player.finish();
      await player.allPlayed;
      run.playedMs = (ctx.currentTime - player.began) * 1000;  // on the audio clock, from the first chunk's start
    } else {
      await playToEnd(abort.signal);
      run.playedMs = $("audio").currentTime * 1000;
    }
    run.duration = $("audio").duration || 0;  // a WAV's player may not have read its header yet
    run.played = !run.error;
    wave.draw(run.audioSeconds);
  } catch (e) {
    run.error = run.error || (e.name === "AbortError" ? "stopped" : e.message);
    $("speak-error").textContent = run.error;
  } finally {
    $("speak-button").disabled = false;
    $("stop-button").disabled = true;
  }
}

function stopSpeaking() {
  if (!state.run) return;
  if (!state.run.run.played) state.run.run.error = "stopped";
  state.run.abort.abort();  // the gateway cancels the generation when the connection goes
  state.run.player?.stop();
  $("audio").pause();
  state.run = null;
}

// ---- the voices tab -------------------------------------------------------------------------------

async function storeVoice(event) {
  event.preventDefault();
  const file = $("voice-file").files[0];
  const clip = state.voiceClip || (file && (await asClip(file, file.name)));
  if (!clip) throw new Error("choose an audio file or record one");
  const form = new FormData();
  form.append("name", $("voice-name").value);
  form.append("audio_sample", clip.wav, "reference.wav");
  if ($("voice-transcript").value) form.append("transcript", $("voice-transcript").value);
  if ($("voice-model").value) form.append("model", $("voice-model").value);
  $("voice-status").textContent = "encoding…";
  const voice = await (await api("/v1/audio/voices", { method: "POST", body: form })).json();
  $("voice-status").textContent = `stored ${voice.id} (${voice.frames} frames)`;
  state.voiceClip = null;
  $("voice-form").reset();
  await loadVoices();
}

// ---- wiring ---------------------------------------------------------------------------------------

function showTab(name) {
  for (const tab of document.querySelectorAll(".tab")) tab.classList.toggle("active", tab.dataset.tab === name);
  for (const panel of document.querySelectorAll(".panel")) panel.hidden = panel.id !== name;
}

window.addEventListener("DOMContentLoaded", async () => {
  for (const tab of document.querySelectorAll(".tab")) tab.onclick = () => showTab(tab.dataset.tab);
  $("model").onchange = () => {
    showKnobs();
    listVoices();
  };
  $("speak-button").onclick = speak;
  $("stop-button").onclick = stopSpeaking;
  $("clip-file").onchange = () => guard($("speak-error"), async () => {
    const file = $("clip-file").files[0];
    if (file) await setClip(await asClip(file, file.name));
  });
  recorder($("clip-record"), $("speak-error"), (clip) => guard($("speak-error"), () => setClip(clip)));
  recorder($("voice-record"), $("voice-status"), (clip) => {
    state.voiceClip = clip;
    $("voice-status").textContent = `recorded ${(clip.wav.size / 1024).toFixed(0)} KiB; name it and store it`;
  });
  $("voice-form").onsubmit = (e) => guard($("voice-status"), () => storeVoice(e));
  const failed = await guard($("speak-error"), async () => {
    await loadModels();
    await loadVoices();
  });
  page.ready = !failed;
});
